"""GET /batch: serve the next formed batch, forming batches when none is left.

As in atroposlib, the first GET /batch after data arrives forms every full batch
it can at once, advances the step by their number, and then serves them one per
call (the last formed first) before forming more. Forming and claiming happen in
one transaction, which on PostgreSQL takes the run row's lock first (`run_state`):
several hubs on one database serve in turn, no batch is formed or served twice, and
no two transactions take their locks in opposite orders.

Groups are stored as the JSON they will be served as, deflated; a batch is their
segments joined with the JSON around them (app/atropos/segments.py), without
parsing them again (except to fill missing inference_logprobs, when asked to).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

import orjson
import sqlalchemy as sa

from app.atropos import lease
from app.atropos.logprobs import fill_inference_logprobs
from app.atropos.packing import EnvShare, Item, form_batches
from app.atropos.presence import counts
from app.atropos.segments import Segment, deflate, inflate, literal
from app.atropos.tables import (
    ATROPOS_BATCH_STATES,
    ATROPOS_BATCHES,
    ENVS,
    GROUPS,
    SEGMENTS,
    STATE,
    AtroposBatchState,
    AtroposDb,
    AtroposGroupState,
    AtroposRunState,
    Contention,
    drop_served_groups,
    move_batch,
    move_groups,
    run_state,
)
from app.db.dialect import dialect_of, skip_locked
from app.db.types import utcnow

log = logging.getLogger("atropos.batch")

NOT_REGISTERED = {
    "status": "error",
    "message": "Trainer not registered. Call /register first.",
    "batch": [],
}
NO_BATCH = b'{"batch":null}'
_OPEN, _COMMA, _CLOSE = b'{"batch":[', b",", b"]}"


@dataclass(frozen=True, slots=True)
class _Claimed:
    id: int
    group_ids: list[int]


@dataclass(frozen=True, slots=True)
class _Stored:
    json: Segment
    fill_logprobs: bool


async def next_batch(
    db: AtroposDb, *, ack: bool, lease_seconds: float, env_timeout: float, fill_logprobs: bool
) -> list[Segment]:
    """The JSON body of GET /batch, in segments: `{"batch": [group, ...]}` (with
    `"batch_id"` when leased), `{"batch": null}`, or atroposlib's not-registered
    error."""
    outcome = await db.write(lambda conn: _next_batch(conn, ack, lease_seconds, env_timeout))
    if outcome is None:
        return [literal(NO_BATCH)]
    if isinstance(outcome, bytes):
        return [literal(outcome)]
    stored, lease_id = outcome
    return _body(stored, lease_id, fill_logprobs)


def _next_batch(
    conn: sa.Connection, ack: bool, lease_seconds: float, env_timeout: float
) -> bytes | tuple[list[_Stored], str | None] | None:
    """One transaction: start the run, re-queue expired leases, claim the next
    formed batch (forming batches first when none is left), and serve or lease it."""
    now = utcnow()
    run = run_state(conn, lock=True)
    if not run.registered:
        return orjson.dumps(NOT_REGISTERED)
    if not run.started:
        conn.execute(
            sa.update(STATE)
            .where(STATE.c.id == 1, STATE.c.started.is_(False))
            .values(started=True, updated_at=now)
        )
    lease.expire(conn, now, lease_seconds)
    claimed = _claim(conn)
    if claimed is None and _form(conn, run, env_timeout):
        claimed = _claim(conn)
    if claimed is None:
        return None
    stored = _stored(conn, claimed.group_ids)
    if ack:
        return stored, lease.grant(conn, claimed.id, now, lease_seconds)
    _served(conn, claimed, now)
    return stored, None


def _claim(conn: sa.Connection) -> _Claimed | None:
    query = (
        sa.select(ATROPOS_BATCHES.c.id, ATROPOS_BATCHES.c.group_ids)
        .where(ATROPOS_BATCHES.c.state == AtroposBatchState.PENDING)
        .order_by(ATROPOS_BATCHES.c.seq.desc(), ATROPOS_BATCHES.c.id.desc())
        .limit(1)
    )
    row = conn.execute(skip_locked(query, dialect_of(conn))).first()
    return _Claimed(row.id, list(row.group_ids)) if row else None


def _form(conn: sa.Connection, run: AtroposRunState, env_timeout: float) -> int:
    """Form every batch the queue allows now; returns how many. Only envs heard from
    within env_timeout count for minimum allocations."""
    queue = [
        Item(*row)
        for row in conn.execute(
            sa.select(GROUPS.c.id, GROUPS.c.env_id, GROUPS.c.size)
            .where(GROUPS.c.state == AtroposGroupState.QUEUED)
            .order_by(GROUPS.c.id)
        )
    ]
    if not queue:
        return 0
    now = utcnow()
    envs = [
        EnvShare(row.env_id, counts(row.connected, row.last_seen_at, now, env_timeout), row.share)
        for row in conn.execute(
            sa.select(
                ENVS.c.env_id,
                ENVS.c.connected,
                ENVS.c.last_seen_at,
                ENVS.c.min_batch_allocation.label("share"),
            ).order_by(ENVS.c.env_id)
        )
    ]
    batches = form_batches(queue, run.batch_size, envs)
    if not batches:
        return 0
    grouped = (item.id for batch in batches for item in batch)
    move_groups(conn, grouped, AtroposGroupState.QUEUED, AtroposGroupState.BATCHED)
    top = conn.scalar(sa.select(sa.func.coalesce(sa.func.max(ATROPOS_BATCHES.c.seq), 0)))
    conn.execute(
        sa.insert(ATROPOS_BATCHES),
        [
            {
                "seq": (top or 0) + 1 + i,
                "state": ATROPOS_BATCH_STATES.enter(AtroposBatchState.PENDING),
                "group_ids": [item.id for item in batch],
                "sequences": sum(item.size for item in batch),
                "deliveries": 0,
                "created_at": now,
                "updated_at": now,
            }
            for i, batch in enumerate(batches)
        ],
    )
    conn.execute(
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


def _stored(conn: sa.Connection, group_ids: list[int]) -> list[_Stored]:
    rows = conn.execute(
        sa.select(
            GROUPS.c.id,
            GROUPS.c.bytes,
            GROUPS.c.fill_logprobs,
            SEGMENTS.c.deflated,
            SEGMENTS.c.crc32,
        )
        .join(SEGMENTS, SEGMENTS.c.id == GROUPS.c.segment_id)
        .where(GROUPS.c.id.in_(group_ids))
    )
    by_id = {
        row.id: _Stored(Segment(row.deflated, row.crc32, row.bytes), row.fill_logprobs)
        for row in rows
    }
    missing = [gid for gid in group_ids if gid not in by_id]
    if missing:
        raise Contention(f"groups {missing} of a formed batch are gone")
    return [by_id[gid] for gid in group_ids]


def _served(conn: sa.Connection, claimed: _Claimed, now: datetime) -> None:
    move_batch(
        conn,
        claimed.id,
        (AtroposBatchState.PENDING,),
        AtroposBatchState.SERVED,
        lease_id=None,
        deliveries=ATROPOS_BATCHES.c.deliveries + 1,
        updated_at=now,
    )
    move_groups(conn, claimed.group_ids, AtroposGroupState.BATCHED, AtroposGroupState.SERVED)
    drop_served_groups(conn)


def _body(groups: list[_Stored], lease_id: str | None, fill_logprobs: bool) -> list[Segment]:
    parts = [literal(_OPEN)]
    for i, group in enumerate(groups):
        if i:
            parts.append(literal(_COMMA))
        parts.append(_filled(group.json) if fill_logprobs and group.fill_logprobs else group.json)
    if lease_id is None:
        parts.append(literal(_CLOSE))
    else:
        parts.append(deflate(b'],"batch_id":' + orjson.dumps(lease_id) + b"}"))
    return parts


def _filled(json: Segment) -> Segment:
    """atropos.fill_missing_logprobs: the group with invented inference_logprobs."""
    return deflate(orjson.dumps(fill_inference_logprobs(orjson.loads(inflate(json)))))
