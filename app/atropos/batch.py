"""GET /batch: serve the next formed batch, forming batches when none is left.

As in atroposlib, the first GET /batch after data arrives forms every full batch
it can at once, advances the step by their number, and then serves them one per
call (the last formed first) before forming more. Forming and claiming happen in
one transaction: several hubs on one PostgreSQL form under the run row's lock and
claim with SKIP LOCKED, so no batch is formed or served twice.

Groups are stored as the JSON they will be served as; a batch is their texts
joined, without parsing them again (except to fill missing inference_logprobs).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime

import orjson
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from app.atropos import lease
from app.atropos.logprobs import fill_inference_logprobs
from app.atropos.packing import EnvShare, Item, form_batches
from app.atropos.store import (
    BATCHES,
    ENVS,
    GROUPS,
    STATE,
    AtroposDb,
    BatchState,
    Contention,
    GroupState,
    RunState,
    drop_served_groups,
    move_batch,
    move_groups,
)
from app.db.dialect import skip_locked
from app.db.types import utcnow

log = logging.getLogger("atropos.batch")

NOT_REGISTERED = {
    "status": "error",
    "message": "Trainer not registered. Call /register first.",
    "batch": [],
}
NO_BATCH = b'{"batch":null}'


@dataclass(frozen=True, slots=True)
class _Claimed:
    id: int
    group_ids: list[int]


@dataclass(frozen=True, slots=True)
class _Stored:
    payload: str
    fill_logprobs: bool


async def next_batch(db: AtroposDb, *, ack: bool, lease_seconds: float) -> bytes:
    """The JSON body of GET /batch: `{"batch": [group, ...]}` (with `"batch_id"`
    when leased), `{"batch": null}`, or atroposlib's not-registered error."""
    now = utcnow()
    lease_id: str | None = None
    async with db.writing() as conn:
        run = await db.run_state(conn)
        if not run.registered:
            return orjson.dumps(NOT_REGISTERED)
        if not run.started:
            await conn.execute(
                sa.update(STATE)
                .where(STATE.c.id == 1, STATE.c.started.is_(False))
                .values(started=True, updated_at=now)
            )
        await lease.expire(conn, now)
        claimed = await _claim(conn, db)
        if claimed is None:
            # Form under the run lock; another hub may have formed while we waited.
            run = await db.run_state(conn, lock=True)
            claimed = await _claim(conn, db)
            if claimed is None and run.registered and await _form(conn, run):
                claimed = await _claim(conn, db)
        if claimed is None:
            return NO_BATCH
        stored = await _stored(conn, claimed.group_ids)
        if ack:
            lease_id = await lease.grant(conn, claimed.id, now, lease_seconds)
        else:
            await _served(conn, claimed, now)
    # Assembled after the commit, outside the writer lock.
    return await asyncio.to_thread(_body, stored, lease_id)


async def _claim(conn: AsyncConnection, db: AtroposDb) -> _Claimed | None:
    query = (
        sa.select(BATCHES.c.id, BATCHES.c.group_ids)
        .where(BATCHES.c.state == BatchState.PENDING)
        .order_by(BATCHES.c.seq.desc(), BATCHES.c.id.desc())
        .limit(1)
    )
    row = (await conn.execute(skip_locked(query, db.dialect))).first()
    return _Claimed(row.id, list(row.group_ids)) if row else None


async def _form(conn: AsyncConnection, run: RunState) -> int:
    """Form every batch the queue allows now; returns how many."""
    queue = [
        Item(*row)
        for row in await conn.execute(
            sa.select(GROUPS.c.id, GROUPS.c.env_id, GROUPS.c.size)
            .where(GROUPS.c.state == GroupState.QUEUED)
            .order_by(GROUPS.c.id)
        )
    ]
    if not queue:
        return 0
    envs = [
        EnvShare(*row)
        for row in await conn.execute(
            sa.select(ENVS.c.env_id, ENVS.c.connected, ENVS.c.min_batch_allocation).order_by(
                ENVS.c.env_id
            )
        )
    ]
    # Pure CPU over (id, env, size) only; a thread keeps the event loop answering.
    batches = await asyncio.to_thread(form_batches, queue, run.batch_size, envs)
    if not batches:
        return 0
    grouped = (item.id for batch in batches for item in batch)
    await move_groups(conn, grouped, GroupState.QUEUED, GroupState.BATCHED)
    top = await conn.scalar(sa.select(sa.func.coalesce(sa.func.max(BATCHES.c.seq), 0)))
    now = utcnow()
    await conn.execute(
        sa.insert(BATCHES),
        [
            {
                "seq": (top or 0) + 1 + i,
                "state": BatchState.PENDING,
                "group_ids": [item.id for item in batch],
                "sequences": sum(item.size for item in batch),
                "deliveries": 0,
                "created_at": now,
                "updated_at": now,
            }
            for i, batch in enumerate(batches)
        ],
    )
    await conn.execute(
        sa.update(STATE)
        .where(STATE.c.id == 1)
        .values(step=STATE.c.step + len(batches), updated_at=now)
    )
    log.info(
        "formed %d batches of %d sequences; step %d -> %d",
        len(batches),
        run.batch_size,
        run.step,
        run.step + len(batches),
    )
    return len(batches)


async def _stored(conn: AsyncConnection, group_ids: list[int]) -> list[_Stored]:
    rows = await conn.execute(
        sa.select(GROUPS.c.id, GROUPS.c.payload, GROUPS.c.fill_logprobs).where(
            GROUPS.c.id.in_(group_ids)
        )
    )
    by_id = {row.id: _Stored(row.payload, row.fill_logprobs) for row in rows}
    missing = [gid for gid in group_ids if gid not in by_id]
    if missing:
        raise Contention(f"groups {missing} of a formed batch are gone")
    return [by_id[gid] for gid in group_ids]


async def _served(conn: AsyncConnection, claimed: _Claimed, now: datetime) -> None:
    await move_batch(
        conn,
        claimed.id,
        (BatchState.PENDING,),
        BatchState.SERVED,
        lease_id=None,
        deliveries=BATCHES.c.deliveries + 1,
        updated_at=now,
    )
    await move_groups(conn, claimed.group_ids, GroupState.BATCHED, GroupState.SERVED)
    await drop_served_groups(conn)


def _body(groups: list[_Stored], lease_id: str | None) -> bytes:
    parts = [_served_json(group) for group in groups]
    body = b'{"batch":[' + b",".join(parts) + b"]"
    if lease_id is not None:
        body += b',"batch_id":' + orjson.dumps(lease_id)
    return body + b"}"


def _served_json(group: _Stored) -> bytes:
    if not group.fill_logprobs:
        return group.payload.encode()
    return orjson.dumps(fill_inference_logprobs(orjson.loads(group.payload)))
