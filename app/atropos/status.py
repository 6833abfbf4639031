"""GET /status and GET /status-env: the step, the queue, and an env's share.

/status-env computes what atroposlib's does, field for field, from the queue's
per-env totals (one aggregate query instead of a walk over the queue), counting only
the envs heard from lately (app/atropos/presence.py); beyond atroposlib's fields it
answers `last_seen`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from app.atropos.presence import Presence, counts, record
from app.atropos.tables import (
    ATROPOS_BATCHES,
    ENVS,
    GROUPS,
    STATE,
    WAITING,
    AtroposDb,
    AtroposGroupState,
    AtroposRunState,
    run_state,
)
from app.db.types import utcnow
from app.errors import NotFound

# The least env_weight an env is told, so that no env is starved completely.
MIN_ENV_WEIGHT = 0.01


@dataclass(frozen=True, slots=True)
class _RegisteredEnv:
    env_id: int
    real_name: str
    max_token_length: int
    weight: float
    group_size: int
    min_batch_allocation: float | None
    connected: bool
    last_seen_at: datetime

    def counts(self, now: datetime, timeout: float) -> bool:
        return counts(self.connected, self.last_seen_at, now, timeout)


@dataclass(frozen=True, slots=True)
class _Queued:
    """The queue's groups of one env (or of no env: env_id None)."""

    sequences: int
    largest: int


async def status(db: AtroposDb) -> dict[str, Any]:
    def work(conn: sa.Connection) -> dict[str, Any]:
        queued = conn.scalar(
            sa.select(sa.func.count())
            .select_from(GROUPS)
            .where(GROUPS.c.state == AtroposGroupState.QUEUED)
        )
        return {"current_step": run_state(conn).step, "queue_size": queued or 0}

    return await db.read(work)


async def status_env(db: AtroposDb, presence: Presence, env_id: int) -> dict[str, Any]:
    if presence.due([env_id]):  # the env asking is alive
        await db.write(lambda conn: record(conn, [env_id], utcnow()))

    def work(
        conn: sa.Connection,
    ) -> tuple[AtroposRunState, list[_RegisteredEnv], dict[int | None, _Queued]]:
        return run_state(conn), _envs(conn), _queued_by_env(conn)

    run, envs, queue = await db.read(work)
    env = next((e for e in envs if e.env_id == env_id), None)
    if env is None:
        raise NotFound(f"no env registered with env_id {env_id}", field="env_id")

    now = utcnow()
    counting = [e for e in envs if e.counts(now, presence.timeout)]
    total = sum(e.max_token_length * max(0.0, e.weight) for e in counting)
    share = env.max_token_length * env.weight / total if total else 0.0
    env_weight = max(MIN_ENV_WEIGHT, share)

    total_min_allocation = 0.0
    for e in counting:
        if e.min_batch_allocation is not None:
            total_min_allocation += e.min_batch_allocation
    unallocated_fraction = 1.0 - min(total_min_allocation, 1.0)

    largest = max([1, *(q.largest for q in queue.values())])
    own = queue.get(env_id)
    own_sequences = own.sequences if own else 0
    # An env whose groups in the queue are larger than it registered (a dynamic
    # group size) is counted, and from now on buffered, by the larger size.
    group_size = max(env.group_size, own.largest if own else 0)
    if group_size > env.group_size:
        await _raise_group_size(db, env_id, group_size)

    minimums: dict[int | None, int] = {
        e.env_id: int(run.batch_size * e.min_batch_allocation)
        for e in counting
        if e.min_batch_allocation is not None
    }
    available_from_others = 0
    if largest > 1:
        for other, queued in queue.items():
            if other == env_id:
                continue
            packed = math.ceil(queued.sequences / largest) * largest
            available_from_others += max(0, packed - minimums.get(other, 0))

    return {
        "current_step": run.step,
        "queue_size": (own_sequences + available_from_others) // group_size,
        "unallocated_fraction": unallocated_fraction,
        "self_queue_size": own_sequences // group_size,
        "max_group_size": largest,
        "env_weight": env_weight,
        "last_seen": env.last_seen_at.isoformat(),
    }


async def env_stats(db: AtroposDb, timeout: float) -> list[dict[str, Any]]:
    """Every registered env, for /v1/stats: whether it counts, and when it was last
    heard from."""
    envs = await db.read(_envs)
    now = utcnow()
    return [
        {
            "env_id": e.env_id,
            "name": e.real_name,
            "connected": e.connected,
            "counting": e.counts(now, timeout),
            "last_seen": e.last_seen_at.isoformat(),
        }
        for e in envs
    ]


async def queue_figures(db: AtroposDb) -> dict[str, Any]:
    """The trainer's step and the queue, for /v1/stats and /metrics: every group ever
    received, those waiting to be served (by state) and their bytes."""

    def work(conn: sa.Connection) -> dict[str, Any]:
        size = sa.func.coalesce(sa.func.sum(GROUPS.c.bytes), 0)
        rows = conn.execute(
            sa.select(GROUPS.c.state, sa.func.count(), size).group_by(GROUPS.c.state)
        ).all()
        state = conn.execute(
            sa.select(STATE.c.step, STATE.c.groups_dropped).where(STATE.c.id == 1)
        ).one()
        waiting = {s.value: 0 for s in WAITING}
        nbytes = 0
        for group_state, n, size in rows:
            if group_state in waiting:
                waiting[group_state] = int(n)
                nbytes += int(size)
        return {
            "step": int(state.step),
            "groups_received": int(state.groups_dropped) + sum(int(n) for _, n, _ in rows),
            "groups_waiting": waiting,
            "queue_bytes": nbytes,
        }

    return await db.read(work)


def _envs(conn: sa.Connection) -> list[_RegisteredEnv]:
    rows = conn.execute(
        sa.select(
            ENVS.c.env_id,
            ENVS.c.real_name,
            ENVS.c.max_token_length,
            ENVS.c.weight,
            ENVS.c.group_size,
            ENVS.c.min_batch_allocation,
            ENVS.c.connected,
            ENVS.c.last_seen_at,
        ).order_by(ENVS.c.env_id)
    )
    return [_RegisteredEnv(**row._mapping) for row in rows]


def _queued_by_env(conn: sa.Connection) -> dict[int | None, _Queued]:
    rows = conn.execute(
        sa.select(GROUPS.c.env_id, sa.func.sum(GROUPS.c.size), sa.func.max(GROUPS.c.size))
        .where(GROUPS.c.state == AtroposGroupState.QUEUED)
        .group_by(GROUPS.c.env_id)
    )
    return {env_id: _Queued(int(total), int(largest)) for env_id, total, largest in rows}


async def _raise_group_size(db: AtroposDb, env_id: int, group_size: int) -> None:
    def work(conn: sa.Connection) -> None:
        conn.execute(
            sa.update(ENVS)
            .where(ENVS.c.env_id == env_id, ENVS.c.group_size < group_size)
            .values(group_size=group_size)
        )

    await db.write(work)


async def overview(db: AtroposDb) -> dict[str, Any]:
    """Everything the dashboard shows of the Atropos API: the trainer's registration,
    the envs (every column, so that later ones such as when an env was last heard
    from show up), and the queue and batches by state."""

    def work(conn: sa.Connection) -> dict[str, Any]:
        state = conn.execute(sa.select(STATE).where(STATE.c.id == 1)).first()
        envs = conn.execute(sa.select(ENVS).order_by(ENVS.c.env_id))
        groups = conn.execute(
            sa.select(GROUPS.c.state, sa.func.count(),
                      sa.func.coalesce(sa.func.sum(GROUPS.c.size), 0))
            .group_by(GROUPS.c.state)
        )
        batches = conn.execute(
            sa.select(ATROPOS_BATCHES.c.state, sa.func.count()).group_by(ATROPOS_BATCHES.c.state)
        )
        return {
            "state": dict(state._mapping) if state is not None else {},
            "envs": [dict(row._mapping) for row in envs],
            "groups": {s: {"groups": n, "sequences": int(seqs)} for s, n, seqs in groups},
            "batches": {s: n for s, n in batches},
        }

    return await db.read(work)
