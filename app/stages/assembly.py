"""The assembly stage: the spans of each OTLP trace that has come due become one
trajectory, which goes through the ingest pipeline as any trace does (parsed by the
otlp format, scored, filtered, its tokens counted, in the ingest processes) and is
stored under the trace's id.

A trace is due once its root span has ended and no span has come for
otlp.quiet_seconds, or otlp.max_wait_seconds after its first span. Every step is in
the database (app/ingest/otlp/store.py): spans acknowledged before a crash are
assembled after the restart, and the trajectory and the trace's assembly state are
written in one transaction. A trace that receives spans again is assembled again: its
trajectory is replaced and scored again (its background stages start over) unless it
was batched already; then the spans are kept and counted as late.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.config import OtlpConfig
from app.db.dialect import dialect_of, insert_ignoring_conflicts
from app.db.models import TRACES
from app.db.types import utcnow
from app.domain import Stage
from app.errors import HubError
from app.formats.otlp import NAME, wire
from app.ingest.otlp import store
from app.ingest.otlp.store import TraceState

log = logging.getLogger("atropos.otlp")

Prepare = Callable[[list[Any], str | None], Awaitable[list[dict[str, Any] | HubError]]]
# A trajectory handed to training is not replaced any more.
SENT = (Stage.BATCHED.value, Stage.DELIVERED.value)
# What a re-assembled trajectory's background stages had made of its previous version.
_STARTED_OVER = {
    "compressed": None,
    "compression": None,
    "stage_error": None,
    "lease_owner": None,
    "lease_expires_at": None,
}


class AssemblyStage:
    name = "assembly"

    def __init__(
        self,
        engine: AsyncEngine,
        config: OtlpConfig,
        prepare: Prepare,
        *,
        batch: int = 64,
        on_advance: Callable[[], None] | None = None,
    ) -> None:
        self._engine = engine
        self._config = config
        self._prepare = prepare  # Ingestor.prepare: the ingest pipeline but the insert
        self._batch = batch
        self._on_advance = on_advance

    @property
    def poll_seconds(self) -> float:
        """How often to look for traces come due: a trajectory appears at most this
        long after it is due."""
        return min(1.0, self._config.quiet_seconds / 4)

    async def run_once(self) -> int:
        async with self._engine.connect() as conn:
            due = await store.due(
                conn, utcnow(), self._config.quiet_seconds, self._config.max_wait_seconds,
                self._batch,
            )
            if not due:
                return 0
            spans = await store.spans_of(conn, [d.trace_id for d in due])
        trace_ids = [d.trace_id for d in due]
        items = [wire.join(_groups(spans[trace_id])) for trace_id in trace_ids]
        rows = await self._prepare(items, NAME)
        outcomes: Counter[str] = Counter()
        async with self._engine.begin() as conn:
            for trace_id, row in zip(trace_ids, rows):
                seen = len(spans[trace_id])
                if isinstance(row, HubError):
                    log.warning("OTLP trace %s makes no trajectory: %s", trace_id, row.message)
                    await store.settle(conn, trace_id, seen, TraceState.REFUSED,
                                       error=row.message)
                    outcomes["refused"] += 1
                    continue
                outcome = await _store(conn, row)
                outcomes[outcome] += 1
                if outcome == "taken":
                    error = (f"trace_id {trace_id} is already stored, from another format; "
                             "its spans are kept but make no trajectory")
                    log.warning("OTLP trace %s: %s", trace_id, error)
                    await store.settle(conn, trace_id, seen, TraceState.REFUSED, error=error)
                else:
                    await store.settle(conn, trace_id, seen, TraceState.ASSEMBLED,
                                       late=outcome == "late")
        log.info("OTLP: %d traces assembled (%s)", len(trace_ids),
                 ", ".join(f"{n} {what}" for what, n in sorted(outcomes.items())))
        if (outcomes["new"] or outcomes["replaced"]) and self._on_advance is not None:
            self._on_advance()
        return len(trace_ids)


async def _store(conn: AsyncConnection, row: dict[str, Any]) -> str:
    """new | replaced (scored again) | unchanged | late (batched already) | taken (the
    trace_id belongs to a trace of another format)."""
    c = TRACES.c
    insert = insert_ignoring_conflicts(dialect_of(conn), TRACES, "trace_id")
    if (await conn.execute(insert.returning(c.trace_id), [row])).first() is not None:
        return "new"
    replaced = await conn.execute(
        sa.update(TRACES)
        .where(
            c.trace_id == row["trace_id"],
            c.source_format == NAME,
            c.stage.not_in(SENT),
            c.content_hash != row["content_hash"],
        )
        .values(**{k: v for k, v in row.items() if k not in ("trace_id", "created_at")},
                **_STARTED_OVER)
    )
    if replaced.rowcount == 1:
        return "replaced"
    stored = (
        await conn.execute(
            sa.select(c.stage, c.source_format).where(c.trace_id == row["trace_id"])
        )
    ).one()
    if stored.source_format != NAME:
        return "taken"
    return "late" if stored.stage in SENT else "unchanged"


def _groups(spans: list[tuple[bytes, bytes, bytes]]) -> list[tuple[bytes, bytes, list[bytes]]]:
    """Spans by the resource and scope they came with, each group in start order."""
    groups: dict[tuple[bytes, bytes], list[bytes]] = {}
    for resource, scope, span in spans:
        groups.setdefault((resource, scope), []).append(span)
    return [(resource, scope, members) for (resource, scope), members in groups.items()]
