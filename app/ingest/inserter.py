"""Group commit for ingest: many requests share one transaction, and each is answered
only after that transaction has committed.

Requests hand their row to `TraceInserter.insert` and wait. One task drains whatever
is queued (up to `max_batch` rows), inserts it with ON CONFLICT DO NOTHING, looks up
the trace_ids that already existed, commits, and only then resolves the waiters. The
queue holds only unacknowledged work: a crash loses nothing that was answered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.db.dialect import dialect_of, insert_ignoring_conflicts
from app.db.engine import database_refusal
from app.db.models import TRACES
from app.errors import Conflict, Invalid, Unavailable

log = logging.getLogger("atropos.ingest")


# What a resent trace is answered with: the stored result.
RESULT_COLUMNS = (
    TRACES.c.trace_id,
    TRACES.c.content_hash,
    TRACES.c.stage,
    TRACES.c.status,
    TRACES.c.total_tokens,
    TRACES.c.reward,
    TRACES.c.env_reward,
    TRACES.c.reward_breakdown,
    TRACES.c.reject_reasons,
)


@dataclass(frozen=True, slots=True)
class Stored:
    """The answer for one trace: the row as committed (or as found, if resent)."""

    trace_id: str
    stage: str
    status: str
    total_tokens: int
    reward: float | None
    env_reward: float | None
    reward_breakdown: dict[str, Any] | None
    reject_reasons: list[dict[str, Any]] | None
    duplicate: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "trace_id": self.trace_id,
            "stage": self.stage,
            "status": self.status,
            "total_tokens": self.total_tokens,
            "reward": self.reward,
            "env_reward": self.env_reward,
            "reward_breakdown": self.reward_breakdown,
            "reject_reasons": self.reject_reasons or [],
            "duplicate": self.duplicate,
        }


@dataclass(slots=True)
class _Pending:
    row: dict[str, Any]
    done: asyncio.Future[Stored]


class TraceInserter:
    def __init__(
        self,
        engine: AsyncEngine,
        *,
        max_batch: int = 256,
        max_queue: int = 10_000,
        on_commit: Callable[[], None] | None = None,
    ) -> None:
        self._engine = engine
        self._max_batch = max_batch
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=max_queue)
        self._on_commit = on_commit
        self._task: asyncio.Task[None] | None = None
        self._writing_since: float | None = None

    def write_wait(self) -> float:
        """How long the write in progress has run (0.0 when idle): long means the
        database is locked by another process or the disk is stalled."""
        since = self._writing_since
        return 0.0 if since is None else time.monotonic() - since

    async def insert(self, row: dict[str, Any]) -> Stored:
        """Store one trace row; returns once it is committed (or found already stored).
        Raises Conflict for a known trace_id with other content."""
        return await self.submit(row)

    def submit(self, row: dict[str, Any]) -> asyncio.Future[Stored]:
        """Queue a row now (rows are written in the order submitted) and return the
        future that resolves once it is committed."""
        if self._task is None or self._task.done():
            raise Unavailable("the trace writer is not running", retry_after=1)
        pending = _Pending(row, asyncio.get_running_loop().create_future())
        try:
            self._queue.put_nowait(pending)
        except asyncio.QueueFull:
            raise Unavailable(
                "ingest queue is full; retry shortly", retry_after=1, code="overloaded"
            ) from None
        return pending.done

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="trace-inserter")

    async def stop(self) -> None:
        """Finish what is queued, then stop."""
        if self._task is None:
            return
        await self._queue.join()
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            self._writing_since = time.monotonic()
            try:
                await self._write(batch)
            except Exception as exc:  # the batch failed as a whole: nobody was acknowledged
                said = database_refusal(exc)
                if said is None:
                    log.exception("storing %d traces failed", len(batch))
                else:
                    log.error("storing %d traces failed: %s", len(batch), said)
                for p in batch:
                    if not p.done.done():
                        p.done.set_exception(
                            Unavailable("the database did not accept the write; retry")
                        )
            finally:
                self._writing_since = None
                for _ in batch:
                    self._queue.task_done()

    async def _write(self, batch: list[_Pending]) -> None:
        # The first occurrence of each trace_id is inserted; later ones in the same
        # batch are answered like any resend.
        first: dict[str, _Pending] = {}
        for p in batch:
            first.setdefault(p.row["trace_id"], p)
        async with self._engine.begin() as conn:
            try:
                new_ids = await _insert(conn, [p.row for p in first.values()])
            except SQLAlchemyError:
                new_ids = await _insert_one_by_one(conn, first.values())
            known = await _lookup(conn, [tid for tid in first if tid not in new_ids])
        if self._on_commit is not None:
            self._on_commit()
        for p in batch:
            if p.done.done():
                continue
            tid = p.row["trace_id"]
            if tid in new_ids and first[tid] is p:
                p.done.set_result(_stored(p.row, duplicate=False))
                continue
            existing = known.get(tid) or first[tid].row
            if existing["content_hash"] == p.row["content_hash"]:
                p.done.set_result(_stored(existing, duplicate=True))
            else:
                p.done.set_exception(
                    Conflict(
                        f"trace_id {tid!r} is already stored with other content; "
                        "send it under a new trace_id",
                        field="trace_id",
                    )
                )


async def _insert(conn: AsyncConnection, rows: list[dict[str, Any]]) -> set[str]:
    # executemany with RETURNING: SQLAlchemy batches it into multi-row INSERTs
    # ("insertmanyvalues") and the compiled statement stays cached.
    stmt = insert_ignoring_conflicts(dialect_of(conn), TRACES, "trace_id")
    result = await conn.execute(stmt.returning(TRACES.c.trace_id), rows)
    return set(result.scalars())


async def _insert_one_by_one(conn: AsyncConnection, pending: Any) -> set[str]:
    """A row the database refused sinks only itself: one savepoint per row."""
    new_ids: set[str] = set()
    for p in pending:
        try:
            async with conn.begin_nested():
                new_ids |= await _insert(conn, [p.row])
        except DBAPIError as exc:
            log.warning("trace %s refused by the database: %s", p.row["trace_id"], exc.orig)
            p.done.set_exception(Invalid(f"the database refused this trace: {exc.orig}"))
    return new_ids


async def _lookup(conn: AsyncConnection, trace_ids: list[str]) -> dict[str, dict[str, Any]]:
    if not trace_ids:
        return {}
    result = await conn.execute(
        sa.select(*RESULT_COLUMNS).where(TRACES.c.trace_id.in_(trace_ids))
    )
    return {row.trace_id: dict(row._mapping) for row in result}


def _stored(row: dict[str, Any], *, duplicate: bool) -> Stored:
    return Stored(
        trace_id=row["trace_id"],
        stage=row["stage"],
        status=row["status"],
        total_tokens=row["total_tokens"],
        reward=row["reward"],
        env_reward=row["env_reward"],
        reward_breakdown=row["reward_breakdown"],
        reject_reasons=row["reject_reasons"],
        duplicate=duplicate,
    )
