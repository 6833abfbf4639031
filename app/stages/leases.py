"""Row leases: how a stage claims work so that no two workers process the same row,
and a dead worker's claims expire.

A claim is one statement, `WITH picked AS (SELECT ... [FOR UPDATE SKIP LOCKED])
UPDATE ... WHERE id IN picked AND <lease free> RETURNING ...`: atomic on SQLite's
single writer and, with SKIP LOCKED, free of waiting on PostgreSQL. The final move
of a claimed row checks `lease_owner` so that a worker whose lease expired cannot
overwrite its successor.

Work that may outlast a lease (a model call, a training job) keeps it with a
`Heartbeat`, which renews the leases of the rows being worked on every third of the
lease: without it a slow call lost its trace to a second worker, and the work (and its
cost) was done twice.

A failed attempt is retried through the lease too (`retry_later`): the row stays
leased until its backoff has passed, then any worker may claim it again. The claim
counts the attempts; `retry_later` alone compares them with the policy's limit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.config import RetryPolicy
from app.db.dialect import dialect_of, picked_once, writing
from app.db.errors import outage_of
from app.db.moves import RELEASED
from app.db.types import utcnow
from app.waits import event_set_within

log = logging.getLogger("atropos.worker")


def worker_id() -> str:
    """host:pid:random, so that a lease names the process that holds it."""
    return f"{socket.gethostname()[:32]}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class Lease:
    seconds: float = 30
    owner: str = field(default_factory=worker_id)


def lease_is_free(table: sa.Table) -> sa.ColumnElement[bool]:
    return sa.or_(table.c.lease_expires_at.is_(None), table.c.lease_expires_at < utcnow())


def claim(
    conn: sa.Connection,
    table: sa.Table,
    *,
    where: sa.ColumnElement[bool],
    order_by: Any,
    limit: int,
    lease: Lease,
    returning: list[Any],
    longest_backoff: float = 0,
) -> list[sa.Row[Any]]:
    """Lease up to `limit` rows matching `where` (oldest by `order_by` first) whose
    lease is free or expired; returns them with `attempts` already counted.

    A lease set before the clock stepped back expires further off than any lease or
    backoff (`longest_backoff`, of `retry_later`) lasts: its expiry is clamped to now +
    that first, so that a backward step holds no row longer than a lease.

    Synchronous, so that it runs whole in the hub's writer (`OneHop.run`): a claim in
    the stages' write turn took one trip through the event loop per statement, and
    ingest's commits waited behind it."""
    key = next(iter(table.primary_key.columns))
    longest = utcnow() + timedelta(seconds=max(lease.seconds, longest_backoff))
    conn.execute(
        sa.update(table)
        .where(where, table.c.lease_expires_at > longest)
        .values(lease_expires_at=longest)
    )
    pick = sa.select(key).where(where, lease_is_free(table)).order_by(order_by).limit(limit)
    picked = picked_once(pick, dialect_of(conn))
    stmt = (
        sa.update(table)
        .where(key.in_(sa.select(picked.c[key.name])), where, lease_is_free(table))
        .values(
            lease_owner=lease.owner,
            lease_expires_at=utcnow() + timedelta(seconds=lease.seconds),
            attempts=table.c.attempts + 1,
        )
        .returning(*returning)
    )
    return list(conn.execute(stmt).all())


def held_by(table: sa.Table, lease: Lease) -> sa.ColumnElement[bool]:
    return table.c.lease_owner == lease.owner


async def renew(
    conn: AsyncConnection, table: sa.Table, keys: Collection[Any], lease: Lease
) -> set[Any]:
    """Extend the held leases of the rows `keys` by their full length; returns the keys
    renewed (the others were lost to another worker)."""
    key = next(iter(table.primary_key.columns))
    result = await conn.execute(
        sa.update(table)
        .where(key.in_(list(keys)), held_by(table, lease))
        .values(lease_expires_at=utcnow() + timedelta(seconds=lease.seconds))
        .returning(key)
    )
    return set(result.scalars())


class Heartbeat:
    """Keeps the leases of the rows a worker is working on: one task renews all of
    them (one UPDATE) every third of the lease, for as long as any is held. `lost` is
    the warning for a row whose lease another worker took meanwhile (%s: its key)."""

    def __init__(self, engine: AsyncEngine, table: sa.Table, lease: Lease, *, lost: str) -> None:
        self._engine = engine
        self._table = table
        self._lease = lease
        self._lost = lost
        self._held: set[Any] = set()
        self._task: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()  # set when nothing is held: the task ends at once

    @contextmanager
    def holding(self, keys: Iterable[Any]) -> Iterator[None]:
        """The leases of `keys` are kept for the duration of the block."""
        keys = set(keys)
        self._held |= keys
        if keys:
            self._idle.clear()
            if self._task is None or self._task.done():
                self._task = asyncio.create_task(
                    self._beat(), name=f"heartbeat-{self._table.name}"
                )
        try:
            yield
        finally:
            self._held -= keys
            if not self._held:
                self._idle.set()

    async def _beat(self) -> None:
        while self._held:
            if await event_set_within(self._idle, self._lease.seconds / 3):
                continue  # all released (unless more was taken since): look again
            held = set(self._held)
            try:
                async with writing(self._engine) as conn:
                    renewed = await renew(conn, self._table, held, self._lease)
            except (SQLAlchemyError, OSError) as exc:
                # The next beat tries again; the lease has two more thirds to run.
                if not outage_of(self._engine).failed(exc, f"renewing {self._table.name} leases"):
                    log.warning("renewing %d %s leases failed: %s", len(held), self._table.name,
                                exc)
                continue
            for key in held - renewed:
                if key in self._held:
                    log.warning(self._lost, key)
                    self._held.discard(key)


async def retry_later(
    conn: AsyncConnection,
    table: sa.Table,
    key_value: Any,
    attempts: int,
    *,
    lease: Lease,
    policy: RetryPolicy,
    give_up: sa.Update,
    wake: Callable[[], None] | None = None,
    **record: Any,
) -> float | None:
    """After failed attempt `attempts` on a row `lease` holds: while the policy allows
    another, keep the lease but shorten it to the backoff, so that any worker may claim
    the row once it runs out (and `wake` the stages then); returns the backoff. After
    the last attempt: `give_up` (the move to the failed state) with the lease released;
    returns None. `record` (the error) is written either way."""
    key = next(iter(table.primary_key.columns))
    now = utcnow()
    if attempts >= policy.max_attempts:
        delay = None
        stmt = give_up.values(**RELEASED)
    else:
        delay = policy.delay(attempts)
        stmt = sa.update(table).values(lease_expires_at=now + timedelta(seconds=delay))
        if wake is not None:
            # When the row is due, not at the next flush interval.
            asyncio.get_running_loop().call_later(delay + 0.05, wake)
    if "updated_at" in table.c:
        stmt = stmt.values(updated_at=now)
    await conn.execute(stmt.where(key == key_value, held_by(table, lease)).values(**record))
    return delay
