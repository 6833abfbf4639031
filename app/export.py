"""`atropos export`: stored traces to a training file, one record per line (JSONL) in
any export format.

Streamed: traces are read in pages of PAGE rows by keyset (created_at, trace_id), each
page written and dropped before the next is read, so memory stays flat whatever the
size of the database, and no transaction stays open for the whole export. Oldest first.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import IO, Any

import orjson
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app import formats
from app.db.models import TraceRow
from app.domain import Stage, Trace

TRACES = TraceRow.__table__
PAGE = 500
# Rejected traces are kept for inspection, not for training.
DEFAULT_STAGES = tuple(s.value for s in Stage if s not in (Stage.RECEIVED, Stage.REJECTED))
_RELATIVE = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


@dataclass(frozen=True)
class ExportQuery:
    fmt: str
    compressed: bool = False  # the compressed view where a trace has one
    min_reward: float | None = None
    since: datetime | None = None
    stages: tuple[str, ...] = DEFAULT_STAGES

    def clauses(self) -> list[sa.ColumnElement[bool]]:
        c = TRACES.c
        clauses = [c.stage.in_(self.stages)]
        if self.min_reward is not None:
            clauses.append(c.reward >= self.min_reward)
        if self.since is not None:
            clauses.append(c.created_at >= self.since)
        return clauses


def parse_since(value: str) -> datetime:
    """An ISO date or datetime (UTC unless it says otherwise), or an age: 30m, 12h, 7d."""
    if match := _RELATIVE.fullmatch(value.strip()):
        amount, unit = match.groups()
        return datetime.now(UTC) - timedelta(**{_UNITS[unit]: float(amount)})
    when = datetime.fromisoformat(value.strip())
    return when if when.tzinfo else when.replace(tzinfo=UTC)


class Progress:
    """A progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self, total: int, stream: IO[str] = sys.stderr, width: int = 30) -> None:
        self.total, self.done = total, 0
        self._stream, self._width = stream, width
        self._drawn = 0.0

    def advance(self, n: int) -> None:
        self.done += n
        if time.monotonic() - self._drawn >= 0.1:
            self._draw()

    def finish(self) -> None:
        self._draw()
        self._stream.write("\n")
        self._stream.flush()

    def _draw(self) -> None:
        self._drawn = time.monotonic()
        share = self.done / self.total if self.total else 1.0
        filled = int(share * self._width)
        bar = "#" * filled + "-" * (self._width - filled)
        self._stream.write(f"\rexport [{bar}] {self.done}/{self.total} traces {share:4.0%}")
        self._stream.flush()


async def count(engine: AsyncEngine, query: ExportQuery) -> int:
    async with engine.connect() as conn:
        return int((await conn.scalar(sa.select(sa.func.count()).where(*query.clauses()))) or 0)


async def export_traces(
    engine: AsyncEngine, query: ExportQuery, out: IO[bytes], progress: Progress | None = None
) -> int:
    """Write every matching trace to `out` as one JSON line in `query.fmt`; returns how many."""
    c = TRACES.c
    payload = sa.func.coalesce(c.compressed, c.trace) if query.compressed else c.trace
    written = 0
    after: tuple[Any, str] | None = None
    while True:
        page = sa.select(c.created_at, c.trace_id, payload.label("payload")).where(*query.clauses())
        if after is not None:
            page = page.where(sa.tuple_(c.created_at, c.trace_id) > after)
        async with engine.connect() as conn:
            rows = (await conn.execute(page.order_by(c.created_at, c.trace_id).limit(PAGE))).all()
        for row in rows:
            record = formats.export(Trace.model_validate(row.payload), query.fmt)
            out.write(orjson.dumps(record) + b"\n")
        written += len(rows)
        if progress is not None:
            progress.advance(len(rows))
        if len(rows) < PAGE:
            return written
        after = (rows[-1].created_at, rows[-1].trace_id)
