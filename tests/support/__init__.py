"""What the tests share besides fixtures (those stay in tests/conftest.py): hubs in
process and in their own processes, databases, builders of traces, waiting on a
condition, and the fake servers that stand in for services unreachable from here."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Real agent trajectories, shared between checkouts (never copied into the repo).
REAL = ROOT.parent / "shared" / "fixtures" / "real"
