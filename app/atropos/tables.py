"""The Atropos tables, their states, and the one way to write them.

Every write runs on `AtroposDb.writer`, the hub's one: `AtroposDb.write(work)` for
the trainer's and the envs' calls, the group commits (app/db/group_commit.py) for
groups sent and the hub's env's rollouts. Each is one transaction that is the
database's writer from its first statement (SQLite) and, on PostgreSQL, locks the
rows it depends on. Reads that need no consistency with a later write use
`reading()` or `read(work)`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.db import models
from app.db.dialect import Dialect, OneHop, dialect_of, for_update
from app.db.moves import StateMachine

STATE = models.ATROPOS_STATE
ENVS = models.ATROPOS_ENVS
GROUPS = models.ATROPOS_GROUPS
SEGMENTS = models.ATROPOS_SEGMENTS
ATROPOS_BATCHES = models.ATROPOS_BATCHES
ENV_GROUPS = models.ATROPOS_ENV_GROUPS

T = TypeVar("T")

# Parameters per statement for `id IN (...)`: well under SQLite's and asyncpg's limits.
_IN_CHUNK = 500


class AtroposGroupState(StrEnum):
    BUFFERED = "buffered"  # smaller than its env's group_size; waits for others
    QUEUED = "queued"  # in the queue batches are formed from
    BATCHED = "batched"  # in a formed batch that is pending or leased
    SERVED = "served"  # handed out; kept only while it is the latest example


class AtroposBatchState(StrEnum):
    PENDING = "pending"  # formed, waiting for GET /batch
    LEASED = "leased"  # handed out with ?ack=1, waiting for POST /batch/ack
    SERVED = "served"  # handed out without ack
    ACKED = "acked"  # acknowledged


# Groups still waiting to be served: what the queue bound counts.
WAITING = (AtroposGroupState.BUFFERED, AtroposGroupState.QUEUED, AtroposGroupState.BATCHED)

GROUP_STATES: StateMachine[AtroposGroupState] = StateMachine(
    "Atropos group",
    GROUPS.c.state,
    {
        # Released by copying into the queue as a new row, never moved.
        AtroposGroupState.BUFFERED: set(),
        AtroposGroupState.QUEUED: {AtroposGroupState.BATCHED, AtroposGroupState.SERVED},
        AtroposGroupState.BATCHED: {AtroposGroupState.SERVED},
        AtroposGroupState.SERVED: set(),
    },
    entries={AtroposGroupState.BUFFERED, AtroposGroupState.QUEUED},
)
ATROPOS_BATCH_STATES: StateMachine[AtroposBatchState] = StateMachine(
    "Atropos batch",
    ATROPOS_BATCHES.c.state,
    {
        AtroposBatchState.PENDING: {
            AtroposBatchState.SERVED,
            AtroposBatchState.LEASED,
            AtroposBatchState.ACKED,
        },
        # Acknowledged, or not in time: then pending again (lease.expire).
        AtroposBatchState.LEASED: {AtroposBatchState.ACKED, AtroposBatchState.PENDING},
        AtroposBatchState.SERVED: set(),
        AtroposBatchState.ACKED: set(),
    },
    entries={AtroposBatchState.PENDING},
)


class Contention(Exception):
    """A row was not in the state this transaction read it in: another writer moved
    it. The transaction is rolled back; nothing is half-done."""


@dataclass(frozen=True, slots=True)
class AtroposRunState:
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
    """Every write is one synchronous transaction function, run whole by `write`
    (see dialect.OneHop: on SQLite in a thread of its own, begun IMMEDIATE, so one
    writer at a time and no wait on the event loop per statement). Reads go through
    `reading`."""

    def __init__(self, engine: AsyncEngine, writer: OneHop | None = None) -> None:
        """`writer`: the hub's one (without it, one of its own)."""
        self.engine = engine
        self.dialect: Dialect = dialect_of(engine)
        self._own_writer = writer is None
        self.writer = writer or OneHop(engine)

    async def write(self, work: Callable[[sa.Connection], T]) -> T:
        """Run `work` in one write transaction, committed if it returns."""
        return await self.writer.run(work)

    @asynccontextmanager
    async def reading(self) -> AsyncIterator[AsyncConnection]:
        async with self.engine.connect() as conn:
            yield conn

    async def read(self, work: Callable[[sa.Connection], T]) -> T:
        """Run `work` (synchronous) on a read connection."""
        async with self.engine.connect() as conn:
            return await conn.run_sync(work)

    async def close(self) -> None:
        if self._own_writer:
            await self.writer.close()


def run_state(conn: sa.Connection, *, lock: bool = False) -> AtroposRunState:
    """The run row; with lock, held until commit (PostgreSQL), which makes the holder
    the only one registering, resetting, forming, serving or acknowledging batches.
    Those transactions take it first, before any group or batch row: two hubs serving
    at once used to delete the same served groups, one of them already holding the run
    row and the other about to count the groups on it, and deadlocked."""
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
        query = for_update(query, dialect_of(conn))
    return AtroposRunState(**conn.execute(query).one()._mapping)


def move_groups(
    conn: sa.Connection, ids: Iterable[int], source: AtroposGroupState, target: AtroposGroupState
) -> None:
    """UPDATE ... SET state = target WHERE state = source, for every id or none."""
    move = GROUP_STATES.move(target, expected=[source])
    ids = list(ids)
    moved = 0
    for start in range(0, len(ids), _IN_CHUNK):
        chunk = ids[start : start + _IN_CHUNK]
        moved += conn.execute(move.where(GROUPS.c.id.in_(chunk))).rowcount
    if moved != len(ids):
        raise Contention(f"{len(ids) - moved} of {len(ids)} groups were no longer {source}")


def move_batch(
    conn: sa.Connection,
    batch_id: int,
    sources: tuple[AtroposBatchState, ...],
    target: AtroposBatchState,
    **values: Any,
) -> None:
    result = conn.execute(
        ATROPOS_BATCH_STATES.move(target, expected=sources)
        .where(ATROPOS_BATCHES.c.id == batch_id)
        .values(**values)
    )
    if result.rowcount != 1:
        raise Contention(f"batch {batch_id} was no longer {'/'.join(sources)}")


def drop_served_groups(conn: sa.Connection) -> None:
    """Delete served groups and their segments, except the latest example (the
    newest group that entered the queue), which /latest_example still answers. The
    caller holds the run row's lock (`run_state`)."""
    others = GROUPS.alias("others")  # not correlated with the rows being deleted
    latest = (
        sa.select(sa.func.max(others.c.id))
        .where(others.c.state != AtroposGroupState.BUFFERED)
        .scalar_subquery()
    )
    served = conn.execute(
        sa.select(GROUPS.c.id, GROUPS.c.segment_id).where(
            GROUPS.c.state == AtroposGroupState.SERVED, GROUPS.c.id < latest
        )
    ).all()
    delete_groups(conn, served)


def delete_groups(conn: sa.Connection, rows: Iterable[Any]) -> None:
    """Delete groups (rows with .id and .segment_id), then their segments."""
    rows = list(rows)
    deleted = 0
    for start in range(0, len(rows), _IN_CHUNK):
        chunk = rows[start : start + _IN_CHUNK]
        deleted += conn.execute(
            sa.delete(GROUPS).where(GROUPS.c.id.in_([r.id for r in chunk]))
        ).rowcount
        conn.execute(sa.delete(SEGMENTS).where(
            SEGMENTS.c.id.in_([r.segment_id for r in chunk]), not_awaiting_trajectories()))
    count_dropped(conn, deleted)


def not_awaiting_trajectories() -> sa.ColumnElement[bool]:
    """A segment no sent group waiting to become trajectories still needs (it is
    deleted by the stage that makes them, app/stages/env_groups.py)."""
    waiting = sa.select(ENV_GROUPS.c.segment_id).where(ENV_GROUPS.c.segment_id == SEGMENTS.c.id)
    return ~waiting.exists()


def count_dropped(conn: sa.Connection, groups: int) -> None:
    """`groups` received groups were deleted: still counted as received (/v1/stats)."""
    if groups:
        conn.execute(
            sa.update(STATE)
            .where(STATE.c.id == 1)
            .values(groups_dropped=STATE.c.groups_dropped + groups)
        )
