"""The real long trajectories in ../shared/fixtures/real, read through the hub's own
source adapters (app/import_sources), for the compression tests and bench."""

from __future__ import annotations

from pathlib import Path

from app.domain import Trace
from app.import_sources import Parsed, read_path
from tests.support import REAL

OPENHANDS = sorted(REAL.glob("openhands/multi_swe_bench_*.jsonl"))
SWE_AGENT = sorted(REAL.glob("swe-agent/*.traj"))


def load(path: Path) -> Trace:
    """The one trajectory in `path`."""
    [record] = list(read_path(path))
    assert isinstance(record, Parsed), record
    return record.trace
