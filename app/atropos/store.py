"""The Atropos tables, their states, and the one way to write them.

Every write goes through `AtroposDb.writing()`: a transaction that is the database's
writer from its first statement (SQLite) and, on PostgreSQL, locks the rows it
depends on. Reads that need no consistency with a later write use `reading()`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.db import models
from app.db.dialect import Dialect, begin_immediate, dialect_of, for_update, writer_lock

STATE = models.ATROPOS_STATE
ENVS = models.ATROPOS_ENVS
GROUPS = models.ATROPOS_GROUPS
BATCHES = models.ATROPOS_BATCHES

# Parameters per statement for `id IN (...)`: well under SQLite's and asyncpg's limits.
_IN_CHUNK = 500


class GroupState(StrEnum):
    BUFFERED = "buffered"  # smaller than its env's group_size; waits for others
    QUEUED = "queued"  # in the queue batches are formed from
    BATCHED = "batched"  # in a formed batch that is pending or leased
    SERVED = "served"  # handed out; kept only while it is the latest example


class BatchState(StrEnum):
    PENDING = "pending"  # formed, waiting for GET /batch
    LEASED = "leased"  # handed out with ?ack=1, waiting for POST /batch/ack
    SERVED = "served"  # handed out without ack
    ACKED = "acked"  # acknowledged


# Groups still waiting to be served: what the queue bound counts.
WAITING = (GroupState.BUFFERED, GroupState.QUEUED, GroupState.BATCHED)

GROUP_MOVES: dict[GroupState, set[GroupState]] = {
    GroupState.BUFFERED: set(),  # released by copying into the queue, never moved
    GroupState.QUEUED: {GroupState.BATCHED, GroupState.SERVED},
    GroupState.BATCHED: {GroupState.SERVED},
    GroupState.SERVED: set(),
}
BATCH_MOVES: dict[BatchState, set[BatchState]] = {
    BatchState.PENDING: {BatchState.SERVED, BatchState.LEASED, BatchState.ACKED},
    BatchState.LEASED: {BatchState.ACKED, BatchState.PENDING},
    BatchState.SERVED: set(),
    BatchState.ACKED: set(),
}


class Contention(Exception):
    """A row was not in the state this transaction read it in: another writer moved
    it. The transaction is rolled back; nothing is half-done."""


@dataclass(frozen=True, slots=True)
class RunState:
    registered: bool
    started: bool
    batch_size: int
    max_token_len: int
    wandb_group: str | None
    wandb_project: str | None
    checkpoint_dir: str | None
    save_checkpoint_interval: int | None
    num_steps: int
    step: int


class AtroposDb:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.dialect: Dialect = dialect_of(engine)
        self._lock = writer_lock(self.dialect)

    @asynccontextmanager
    async def writing(self) -> AsyncIterator[AsyncConnection]:
        """A write transaction, committed when the block exits without error."""
        async with self._lock, self.engine.begin() as conn:
            await begin_immediate(conn)
            yield conn

    @asynccontextmanager
    async def reading(self) -> AsyncIterator[AsyncConnection]:
        async with self.engine.connect() as conn:
            yield conn

    async def run_state(self, conn: AsyncConnection, *, lock: bool = False) -> RunState:
        """The run row; with lock, held until commit (PostgreSQL), which makes the
        holder the only one forming batches, registering or resetting."""
        query = sa.select(
            STATE.c.registered,
            STATE.c.started,
            STATE.c.batch_size,
            STATE.c.max_token_len,
            STATE.c.wandb_group,
            STATE.c.wandb_project,
            STATE.c.checkpoint_dir,
            STATE.c.save_checkpoint_interval,
            STATE.c.num_steps,
            STATE.c.step,
        ).where(STATE.c.id == 1)
        if lock:
            query = for_update(query, self.dialect)
        row = (await conn.execute(query)).one()
        return RunState(**row._mapping)


async def move_groups(
    conn: AsyncConnection, ids: Iterable[int], source: GroupState, target: GroupState
) -> None:
    """UPDATE ... SET state = target WHERE state = source, for every id or none."""
    assert target in GROUP_MOVES[source], f"group {source} -> {target}"
    ids = list(ids)
    moved = 0
    for start in range(0, len(ids), _IN_CHUNK):
        chunk = ids[start : start + _IN_CHUNK]
        result = await conn.execute(
            sa.update(GROUPS)
            .where(GROUPS.c.id.in_(chunk), GROUPS.c.state == source)
            .values(state=target)
        )
        moved += result.rowcount
    if moved != len(ids):
        raise Contention(f"{len(ids) - moved} of {len(ids)} groups were no longer {source}")


async def move_batch(
    conn: AsyncConnection,
    batch_id: int,
    sources: tuple[BatchState, ...],
    target: BatchState,
    **values: Any,
) -> None:
    for source in sources:
        assert target in BATCH_MOVES[source], f"batch {source} -> {target}"
    result = await conn.execute(
        sa.update(BATCHES)
        .where(BATCHES.c.id == batch_id, BATCHES.c.state.in_(sources))
        .values(state=target, **values)
    )
    if result.rowcount != 1:
        raise Contention(f"batch {batch_id} was no longer {'/'.join(sources)}")


async def drop_served_groups(conn: AsyncConnection) -> None:
    """Delete served groups, except the latest example (the newest group that
    entered the queue), which /latest_example still answers."""
    others = GROUPS.alias("others")  # not correlated with the row being deleted
    latest = (
        sa.select(sa.func.max(others.c.id))
        .where(others.c.state != GroupState.BUFFERED)
        .scalar_subquery()
    )
    await conn.execute(
        sa.delete(GROUPS).where(GROUPS.c.state == GroupState.SERVED, GROUPS.c.id < latest)
    )
