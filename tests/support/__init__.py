"""What the tests share besides fixtures (those stay in tests/conftest.py): hubs in
process and in their own processes, databases, builders of traces, waiting on a
condition, and the fake servers that stand in for services unreachable from here."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Real agent trajectories, shared between checkouts (never copied into the repo): in
# ../shared beside the checkout, or beside a folder holding it (a worktree in
# ../wt/<branch>).
_CORPUS = Path("shared") / "fixtures" / "real"
REAL = next((p / _CORPUS for p in ROOT.parents if (p / _CORPUS).is_dir()), ROOT.parent / _CORPUS)
