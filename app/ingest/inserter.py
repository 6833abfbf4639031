"""Group commit for ingest: many requests share one transaction, and each is answered
only after that transaction has committed.

Requests hand their row to `TraceInserter.insert` and wait. One task drains whatever
is queued (up to `max_batch` rows), inserts it with ON CONFLICT DO NOTHING, looks up
the trace_ids that already existed, commits, and only then resolves the waiters. The
queue holds only unacknowledged work: a crash loses nothing that was answered.

A row comes ready to insert (`TraceRow`, made in an ingest process): its values in a
form both drivers take as they are, inserted with SQL written once
(`dialect.BulkInsert`), and its answer. The transaction runs whole in one hop
(`dialect.OneHop`: on SQLite in a thread of its own, begun IMMEDIATE), so the event
loop spends a few microseconds a row on it (bench/ingest.py, docs/decisions.md).

`max_wait` (limits.max_write_wait_seconds) bounds every request's wait for its commit:
past it the request is answered 503 and its row withdrawn, never written later. A
row's transaction, once it is committing, is past withdrawing (the commit's answer is
a moment away); a row withdrawn while its transaction still runs (waiting on a lock)
makes that transaction roll back, and the batch is written again without it.

The inserter also says whether the write path is ready (`readiness`, for /readyz):
not while a write has run longer than `max_wait`, nor after a write failed until a
write succeeds again; with no traffic to prove it, a probe write does.

When the database refuses a row of the batch (app/db/errors.py), the transaction is
rolled back (on PostgreSQL nothing more can be done in it) and the batch written again
with a savepoint per row, so that the refused row sinks alone. When the write fails
for any other reason (a lock, a full disk, a lost connection), every row of the batch
is answered 503: none was written.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import search
from app.db.dialect import BulkInsert, OneHop
from app.db.errors import database_error, database_refusal, outage_of, refuses_row
from app.db.models import TRACES
from app.db.schedule import claim_if_due
from app.errors import Conflict, HubError, Unavailable
from app.metrics import DB_COMMITS

log = logging.getLogger("atropos.ingest")
_commits = DB_COMMITS.labels("traces")


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

    def __reduce__(self) -> tuple[Any, ...]:
        # Rows travel back from the ingest processes pickled; a slots dataclass's own
        # pickling walks dataclasses.fields() on every load (~5 us each).
        return (Stored, tuple(getattr(self, name) for name in self.__slots__))

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


# The columns a new trace is written with (the others keep their defaults).
INSERT = BulkInsert(
    TRACES,
    "trace_id",
    (
        "trace_id", "created_at", "updated_at", "status", "stage", "total_tokens",
        "compressed_tokens", "reward", "env_reward", "reward_breakdown", "reject_reasons",
        "scored_with", "source_format", "env", "model", "agent_name", "policy_version",
        "content_hash", "original", "trace", "attempts",
    ),
)


_SOURCE_FORMAT = INSERT.columns.index("source_format")


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One trace, ready to insert: its `values` (INSERT.columns, in the form
    BulkInsert takes), its search text, and its answer once stored."""

    values: tuple[Any, ...]
    search_text: str
    stored: Stored
    content_hash: str

    def __reduce__(self) -> tuple[Any, ...]:
        return (TraceRow, (self.values, self.search_text, self.stored, self.content_hash))

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> TraceRow:
        """From the row as column -> value, and its search_text (`Preparer.row`)."""
        return cls(INSERT.values(row), row["search_text"], _stored(row, duplicate=False),
                   row["content_hash"])

    @property
    def trace_id(self) -> str:
        return self.stored.trace_id

    @property
    def source_format(self) -> str:
        source: str = self.values[_SOURCE_FORMAT]
        return source


@dataclass(slots=True)
class _Pending:
    row: TraceRow
    done: asyncio.Future[Stored]
    # In a transaction that is committing: too late to withdraw.
    sealed: bool = False
    # Answered 503 at its deadline: must not be written.
    withdrawn: bool = False
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class _Withdrawn(Exception):
    """A row of the transaction was withdrawn before its commit: roll back."""


class TraceInserter:
    def __init__(
        self,
        engine: AsyncEngine,
        *,
        max_batch: int = 256,
        max_queue: int = 10_000,
        max_wait: float | None = None,
        retry_after: int = 2,
        on_commit: Callable[[], None] | None = None,
    ) -> None:
        """`max_wait`: the longest a row waits for its commit before it is withdrawn
        and its request answered 503 with `retry_after` (None: no bound, as for
        `atropos import`, whose callers wait for each chunk)."""
        self._engine = engine
        self._max_batch = max_batch
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=max_queue)
        self._max_wait = max_wait
        self._retry_after = retry_after
        self._on_commit = on_commit
        self._task: asyncio.Task[None] | None = None
        self._writing_since: float | None = None
        # Why the last write failed; None once one has succeeded.
        self._failure: str | None = None
        self._probe: asyncio.Task[None] | None = None
        self._outage = outage_of(engine)
        self._hop = OneHop(engine)
        # Sealing (in the hop's thread, on SQLite) and withdrawing (on the event loop)
        # decide a row's fate: one at a time.
        self._deciding = threading.Lock()

    def write_wait(self) -> float:
        """How long the write in progress has run (0.0 when idle): long means the
        database is locked by another process or the disk is stalled."""
        since = self._writing_since
        return 0.0 if since is None else time.monotonic() - since

    def readiness(self, max_wait: float) -> str | None:
        """Why the write path is not ready now (for /readyz), or None. After a failed
        write, a probe write (at most one at a time) finds out when it recovers."""
        waited = self.write_wait()
        if waited > max_wait:
            return (f"no write has finished for {waited:.1f} s "
                    f"(limits.max_write_wait_seconds is {max_wait:g})")
        if self._failure is None:
            return None
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._probe_write(), name="write-probe")
        return f"the last write failed: {self._failure}"

    async def _probe_write(self) -> None:
        """One small write of the hub's own: the `write_probe` row of scheduled_tasks."""
        try:
            await claim_if_due(self._engine, "write_probe", timedelta(0))
        except Exception as exc:
            self._failure = database_refusal(exc) or type(exc).__name__
            self._outage.failed(exc, "probing whether writes work")
        else:
            self._failure = None
            self._outage.works()

    async def insert(self, row: TraceRow) -> Stored:
        """Store one trace row; returns once it is committed (or found already stored).
        Raises Conflict for a known trace_id with other content."""
        return await self.submit(row)

    def submit(self, row: TraceRow) -> asyncio.Future[Stored]:
        """Queue a row now (rows are written in the order submitted) and return the
        future that resolves once it is committed."""
        if self._task is None or self._task.done():
            raise Unavailable("the trace writer is not running", retry_after=1)
        loop = asyncio.get_running_loop()
        pending = _Pending(row, loop.create_future())
        try:
            self._queue.put_nowait(pending)
        except asyncio.QueueFull:
            raise Unavailable(
                "ingest queue is full; retry shortly", retry_after=1, code="overloaded"
            ) from None
        if self._max_wait is not None:
            pending.timer = loop.call_later(self._max_wait, self._withdraw, pending)
        return pending.done

    def _withdraw(self, pending: _Pending) -> None:
        """Its deadline: answer 503 unless it is committed or being committed."""
        with self._deciding:
            if pending.done.done() or pending.sealed:
                return
            pending.withdrawn = True
        pending.done.set_exception(Unavailable(
            f"the database did not commit this trace within {self._max_wait:g} s "
            "(limits.max_write_wait_seconds); it was not stored: send it again",
            retry_after=self._retry_after,
            code="overloaded",
            field="limits.max_write_wait_seconds",
        ))

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
        await self._hop.close()

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            self._writing_since = time.monotonic()
            try:
                await self._write_all(batch)
            except Exception as exc:  # the batch failed as a whole: nobody was acknowledged
                self._failure = database_refusal(exc) or type(exc).__name__
                if not self._outage.failed(exc, "storing traces"):
                    log.exception("storing %d traces failed", len(batch))
                for p in batch:
                    if not p.done.done():
                        p.done.set_exception(
                            Unavailable("the database did not accept the write; retry")
                        )
            else:
                self._failure = None
                self._outage.works()
                _commits.observe(time.monotonic() - self._writing_since)
            finally:
                self._writing_since = None
                for p in batch:
                    if p.timer is not None:
                        p.timer.cancel()
                    self._queue.task_done()

    async def _write_all(self, batch: list[_Pending]) -> None:
        """Write what was not withdrawn; again without what is withdrawn meanwhile."""
        # Rows answered already (refused by the database) are not written again.
        while todo := [p for p in batch if not (p.withdrawn or p.done.done())]:
            try:
                await self._write(todo)
                return
            except _Withdrawn:
                log.info("traces withdrawn (past limits.max_write_wait_seconds) while their "
                         "transaction waited; writing the others again without them")

    def _seal(self, batch: list[_Pending]) -> None:
        """Called last in the transaction, just before its commit: roll back if a row
        was withdrawn meanwhile; else none may be any more."""
        with self._deciding:
            if any(p.withdrawn for p in batch):
                raise _Withdrawn
            for p in batch:
                p.sealed = True

    async def _write(self, batch: list[_Pending]) -> None:
        # The first occurrence of each trace_id is inserted; later ones in the same
        # batch are answered like any resend.
        first: dict[str, _Pending] = {}
        for p in batch:
            first.setdefault(p.row.trace_id, p)
        refused: dict[str, HubError] = {}
        try:
            new_ids, known = await self._hop.run(partial(self._insert_all, batch, first))
        except SQLAlchemyError as exc:
            if not refuses_row(exc):
                raise
            new_ids, known = await self._hop.run(
                partial(self._insert_one_by_one, batch, first, refused)
            )
        if self._on_commit is not None:
            self._on_commit()
        for p in batch:
            if p.done.done():
                continue
            tid = p.row.trace_id
            if tid in refused:  # and so is any other item under its trace_id
                p.done.set_exception(refused[tid])
                continue
            if tid in new_ids and first[tid] is p:
                p.done.set_result(p.row.stored)
                continue
            if tid in known:
                existing, content_hash = known[tid]
            else:  # the first of its batch
                existing, content_hash = first[tid].row.stored, first[tid].row.content_hash
            if content_hash == p.row.content_hash:
                p.done.set_result(_duplicate(existing))
            else:
                p.done.set_exception(
                    Conflict(
                        f"trace_id {tid!r} is already stored with other content; "
                        "send it under a new trace_id",
                        field="trace_id",
                    )
                )

    # The transactions, run whole in one hop (in the hop's thread on SQLite): they
    # touch no future, only the rows and the `_deciding` lock.

    def _insert_all(
        self, batch: list[_Pending], first: dict[str, _Pending], conn: sa.Connection
    ) -> tuple[set[str], dict[str, tuple[Stored, str]]]:
        new_ids = insert_traces(conn, [p.row for p in first.values()])
        known = _lookup(conn, [tid for tid in first if tid not in new_ids])
        self._seal(batch)
        return new_ids, known

    def _insert_one_by_one(
        self,
        batch: list[_Pending],
        first: dict[str, _Pending],
        refused: dict[str, HubError],
        conn: sa.Connection,
    ) -> tuple[set[str], dict[str, tuple[Stored, str]]]:
        """A row the database refused sinks only itself: one savepoint per row, the
        first included. Any other failure ends the transaction (503 for all)."""
        new_ids: set[str] = set()
        refused.clear()
        for tid, p in first.items():
            try:
                with conn.begin_nested():
                    new_ids |= insert_traces(conn, [p.row])
            except SQLAlchemyError as exc:
                if not refuses_row(exc):
                    raise
                refused[tid] = database_error(exc)
                log.warning("trace %r refused by the database: %s", tid, refused[tid])
        known = _lookup(conn, [tid for tid in first if tid not in new_ids and tid not in refused])
        self._seal(batch)
        return new_ids, known


def insert_traces(conn: sa.Connection, rows: Sequence[TraceRow]) -> set[str]:
    """Insert the rows (distinct trace_ids) not stored yet, each with its search text;
    returns the trace_ids that were new."""
    new_ids: set[str] = INSERT.run(conn, [row.values for row in rows])
    search.index(conn, [(row.trace_id, row.search_text) for row in rows
                        if row.trace_id in new_ids])
    return new_ids


def _lookup(conn: sa.Connection, trace_ids: list[str]) -> dict[str, tuple[Stored, str]]:
    """The stored answer and content hash of each of `trace_ids` that is stored."""
    if not trace_ids:
        return {}
    result = conn.execute(sa.select(*RESULT_COLUMNS).where(TRACES.c.trace_id.in_(trace_ids)))
    return {
        row.trace_id: (_stored(row._mapping, duplicate=True), row.content_hash)
        for row in result
    }


def _duplicate(stored: Stored) -> Stored:
    return stored if stored.duplicate else dataclasses.replace(stored, duplicate=True)


def _stored(row: Mapping[Any, Any], *, duplicate: bool) -> Stored:
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
