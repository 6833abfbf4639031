"""Group commit: many requests share one write transaction, and each is answered only
after that transaction has committed. One mechanism for every kind of item the hub
writes on a request's behalf (traces, OTLP spans, Atropos groups, gateway captures):
a kind supplies only `write(conn, items)`.

`submit(item)` queues the item and returns the future of its result. One task per
kind hands a transaction to the hub's one writer (`dialect.OneHop`: on SQLite one
thread, begun IMMEDIATE, shared by every kind, so that they take turns at the file's
lock instead of contending for it). The transaction takes what is queued when it
begins (so everything that arrived while it waited for the lock goes in), up to
`max_items` and `max_weight` (at least one item), calls the kind's `write`, and
commits; only then are the results set. The queue holds only unacknowledged work: a
crash loses nothing that was answered.

The deadline (`max_wait`): an item not committed within it is answered 503 and
withdrawn, never written later. Withdrawing and sealing (the last step of the
transaction before its commit) decide an item's fate one at a time: an item withdrawn
while its transaction still runs (waiting on a lock) makes that transaction roll back,
and the others are written again without it; once sealed, an item is past withdrawing
(its commit's answer is a moment away).

A row the database refuses for what it holds (app/db/errors.refuses_row) is that
item's 422: the batch is written again with a savepoint per item, so that it sinks
alone. Any other failure fails the batch as a whole (503 for all, none written) and is
reported to the database's `Outage` (app/outage.py), which /readyz reads, with
`write_wait` (a transaction running past the deadline) and `failure`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Generic, Protocol, TypeVar

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError

from app.db.dialect import OneHop
from app.db.errors import database_error, database_refusal, refuses_row
from app.errors import HubError, Unavailable
from app.metrics import DB_COMMITS
from app.outage import Outage

log = logging.getLogger("atropos.database")

Item = TypeVar("Item")
Result = TypeVar("Result")
Item_contra = TypeVar("Item_contra", contravariant=True)
Result_co = TypeVar("Result_co", covariant=True)


class Kind(Protocol[Item_contra, Result_co]):
    """What one kind of item supplies to its group commit."""

    # Plural noun, for logs, messages and the db_commit_seconds label: "traces".
    name: str

    def write(
        self, conn: sa.Connection, items: Sequence[Item_contra]
    ) -> Sequence[Result_co | HubError]:
        """Write `items` in the open transaction (synchronous; it may run in the
        writer's thread: no event loop, no futures). Returns one result per item, in
        order: its answer, or the HubError refusing it alone (a conflict, a full
        queue). Raising fails the whole batch."""
        ...


@dataclass(slots=True)
class _Pending(Generic[Item, Result]):
    item: Item
    weight: int
    done: asyncio.Future[Result]
    # In a transaction that is committing: too late to withdraw.
    sealed: bool = False
    # Answered 503 at its deadline: must not be written.
    withdrawn: bool = False
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class _Withdrawn(Exception):
    """An item of the transaction was withdrawn before its commit: roll back."""


class GroupCommit(Generic[Item, Result]):
    def __init__(
        self,
        kind: Kind[Item, Result],
        writer: OneHop,
        outage: Outage,
        *,
        max_items: int = 256,
        max_weight: int | None = None,
        weight: Callable[[Item], int] | None = None,
        max_queue: int | None = None,
        max_wait: float | None = None,
        retry_after: int = 2,
        on_commit: Callable[[list[Item]], None] | None = None,
        synced: bool = True,
    ) -> None:
        """`writer`: the hub's one (the lifespan's). `max_items`, `max_weight` (of
        `weight(item)`, default 1 each): one transaction's bound. `max_queue`: items
        waiting, past which `submit` answers 503. `max_wait`: an item's deadline
        (None: no bound, for callers that wait for each chunk, as `atropos import`).
        `on_commit`: called with the items of each commit that stored something. `synced=False`:
        its items are answered before the commit reaches the disk (`OneHop.run`)."""
        self.kind = kind
        self._writer = writer
        self._outage = outage
        self._max_items = max_items
        self._max_weight = max_weight
        self._weight = weight
        self._max_queue = max_queue
        self._max_wait = max_wait
        self._retry_after = retry_after
        self._on_commit = on_commit
        self._synced = synced
        self._commits = DB_COMMITS.labels(kind.name.lower().replace(" ", "_"))
        # Appended on the event loop, taken by the transaction (in the writer's thread
        # on SQLite): a deque's append and popleft are atomic.
        self._queue: deque[_Pending[Item, Result]] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._writing_since: float | None = None
        self.failure: str | None = None  # why the last write failed; None once one works
        # Sealing (in the writer's thread) and withdrawing (on the event loop) decide
        # an item's fate: one at a time.
        self._deciding = threading.Lock()

    def submit(self, item: Item) -> asyncio.Future[Result]:
        """Queue `item` now (items are written in the order submitted) and return the
        future of its result, set once it is committed."""
        if self._task is None or self._task.done() or self._stopping:
            raise Unavailable(f"the writer of {self.kind.name} is not running", retry_after=1)
        if self._max_queue is not None and len(self._queue) >= self._max_queue:
            raise Unavailable(
                f"too many {self.kind.name} are waiting to be written; retry shortly",
                retry_after=self._retry_after, code="overloaded",
            )
        loop = asyncio.get_running_loop()
        weight = 1 if self._weight is None else self._weight(item)
        pending: _Pending[Item, Result] = _Pending(item, weight, loop.create_future())
        if self._max_wait is not None:
            pending.timer = loop.call_later(self._max_wait, self._withdraw, pending)
        # A caller that stops waiting (its client went away) withdraws the item too,
        # unless it is sealed: what nobody was answered for is not written.
        pending.done.add_done_callback(partial(self._abandoned, pending))
        self._queue.append(pending)
        self._wake.set()
        return pending.done

    def write_wait(self) -> float:
        """How long the write in progress has run (0.0 when idle): long means the
        database is locked by another process or the disk is stalled."""
        since = self._writing_since
        return 0.0 if since is None else time.monotonic() - since

    def start(self) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name=f"group-commit-{self.kind.name}")

    async def stop(self) -> None:
        """Write what is queued (answering it), then stop; `submit` answers 503 from now."""
        if self._task is None:
            return
        self._stopping = True
        self._wake.set()
        await self._task
        self._task = None

    def _abandoned(self, pending: _Pending[Item, Result], done: asyncio.Future[Result]) -> None:
        if done.cancelled():
            with self._deciding:
                pending.withdrawn = not pending.sealed

    def _withdraw(self, pending: _Pending[Item, Result]) -> None:
        """Its deadline: answer 503 unless it is committed or being committed."""
        with self._deciding:
            if pending.done.done() or pending.sealed:
                return
            pending.withdrawn = True
        pending.done.set_exception(Unavailable(
            f"the database did not commit this within {self._max_wait:g} s "
            f"(limits.max_write_wait_seconds); none of these {self.kind.name} was stored: "
            "send them again",
            retry_after=self._retry_after,
            code="overloaded",
            field="limits.max_write_wait_seconds",
        ))

    async def _run(self) -> None:
        while True:
            if not self._queue:
                if self._stopping:
                    return
                self._wake.clear()  # nothing is appended between the check and this
                await self._wake.wait()
                continue
            await self._write_batch()

    async def _write_batch(self) -> None:
        taken: list[_Pending[Item, Result]] = []
        self._writing_since = time.monotonic()
        try:
            results = await self._transactions(taken)
        except Exception as exc:  # the batch failed as a whole: nobody was acknowledged
            self.failure = database_refusal(exc) or type(exc).__name__
            if not taken:  # it failed before taking (no connection, no lock): these fail
                self._take(taken)
            if not self._outage.failed(exc, f"storing {self.kind.name}"):
                log.exception("storing %d %s failed", len(taken), self.kind.name)
            self._settle(taken, None, Unavailable(
                f"the database did not accept the write of these {self.kind.name}; retry",
                retry_after=self._retry_after))
        else:
            if results is not None:  # else every item was withdrawn: nothing was proven
                self.failure = None
                self._outage.works()
                self._commits.observe(time.monotonic() - self._writing_since)
                if self._on_commit is not None:
                    self._on_commit([pending.item for pending in taken])
            self._settle(taken, results, None)
        finally:
            self._writing_since = None

    async def _transactions(
        self, taken: list[_Pending[Item, Result]]
    ) -> list[Result | HubError] | None:
        """Runs the transaction until it commits; again without what was withdrawn
        meanwhile, again item by item if the database refused a row. None when every
        item taken was withdrawn."""
        one_by_one = False
        while True:
            try:
                return await self._writer.run(partial(self._transaction, taken, one_by_one),
                                              synced=self._synced)
            except _Withdrawn:
                log.info("%s withdrawn (past limits.max_write_wait_seconds) while their "
                         "transaction waited; writing the others again without them",
                         self.kind.name)
            except SQLAlchemyError as exc:
                if one_by_one or not refuses_row(exc):
                    raise
                one_by_one = True

    # Run in the writer (its thread on SQLite): touches no future, only the items'
    # flags under `_deciding`.

    def _transaction(
        self, taken: list[_Pending[Item, Result]], one_by_one: bool, conn: sa.Connection
    ) -> list[Result | HubError] | None:
        with self._deciding:
            if not taken:
                self._take(taken)
            taken[:] = [p for p in taken if not p.withdrawn]
        if not taken:
            return None
        items = [p.item for p in taken]
        if one_by_one:
            results = [self._write_alone(conn, item) for item in items]
        else:
            results = list(self.kind.write(conn, items))
        self._seal(taken)
        return results

    def _take(self, taken: list[_Pending[Item, Result]]) -> None:
        """Moves what is queued into `taken`, up to the batch's bounds (at least one)."""
        weight = 0
        while self._queue and len(taken) < self._max_items and (
            not taken or self._max_weight is None or weight < self._max_weight
        ):
            pending = self._queue.popleft()
            if not pending.withdrawn:  # answered 503 while queued: not written
                taken.append(pending)
                weight += pending.weight

    def _write_alone(self, conn: sa.Connection, item: Item) -> Result | HubError:
        """A row the database refuses sinks only its item; any other failure ends the
        transaction (503 for all)."""
        try:
            with conn.begin_nested():
                return self.kind.write(conn, [item])[0]
        except SQLAlchemyError as exc:
            if not refuses_row(exc):
                raise
            refused = database_error(exc)
            log.warning("one of the %s was refused by the database: %s", self.kind.name, refused)
            return refused

    def _seal(self, taken: list[_Pending[Item, Result]]) -> None:
        """Called last in the transaction, just before its commit: roll back if an item
        was withdrawn meanwhile; else none may be any more."""
        with self._deciding:
            if any(p.withdrawn for p in taken):
                taken[:] = [p for p in taken if not p.withdrawn]
                raise _Withdrawn
            for p in taken:
                p.sealed = True

    @staticmethod
    def _settle(
        taken: list[_Pending[Item, Result]],
        results: list[Result | HubError] | None,
        failure: HubError | None,
    ) -> None:
        for n, pending in enumerate(taken):
            if pending.timer is not None:
                pending.timer.cancel()
            if pending.done.done():
                continue  # withdrawn, or its client went away
            result = failure if results is None else results[n]
            if isinstance(result, HubError):
                pending.done.set_exception(result)
            else:
                pending.done.set_result(result)  # type: ignore[arg-type]
