"""Leases for GET /batch?ack=1: a batch handed out under a lease id (its batch_id)
stays the trainer's until POST /batch/ack confirms it, or until the lease runs out,
when it goes back on top of the pending batches and is served again next.

A late ack is still taken while the batch has not been handed to anyone else (even
after its lease ran out); once it has, the old batch_id is unknown."""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from app.atropos.tables import (
    ATROPOS_BATCH_STATES,
    ATROPOS_BATCHES,
    AtroposBatchState,
    AtroposDb,
    AtroposGroupState,
    drop_served_groups,
    move_batch,
    move_groups,
    run_state,
)
from app.db.dialect import dialect_of, for_update
from app.db.types import utcnow
from app.errors import NotFound

log = logging.getLogger("atropos.lease")


def grant(conn: sa.Connection, batch_id: int, now: datetime, seconds: float) -> str:
    lease_id = uuid.uuid4().hex
    move_batch(
        conn,
        batch_id,
        (AtroposBatchState.PENDING,),
        AtroposBatchState.LEASED,
        lease_id=lease_id,
        lease_expires_at=now + timedelta(seconds=seconds),
        deliveries=ATROPOS_BATCHES.c.deliveries + 1,
        updated_at=now,
    )
    return lease_id


def expire(conn: sa.Connection, now: datetime, seconds: float) -> None:
    """Leases past their deadline: the batch is pending again, next in line. A deadline
    further off than a lease lasts (`seconds`) was set before the clock stepped back:
    it is brought to now + `seconds` first, so that the step holds no batch longer."""
    conn.execute(
        sa.update(ATROPOS_BATCHES)
        .where(ATROPOS_BATCHES.c.state == AtroposBatchState.LEASED,
               ATROPOS_BATCHES.c.lease_expires_at > now + timedelta(seconds=seconds))
        .values(lease_expires_at=now + timedelta(seconds=seconds))
    )
    others = ATROPOS_BATCHES.alias("others")  # not correlated with the row being updated
    top = sa.select(sa.func.coalesce(sa.func.max(others.c.seq), 0) + 1).scalar_subquery()
    expired = (
        conn.execute(
            ATROPOS_BATCH_STATES.move(
                AtroposBatchState.PENDING, expected=[AtroposBatchState.LEASED]
            )
            .where(ATROPOS_BATCHES.c.lease_expires_at < now)
            .values(seq=top, updated_at=now)
            .returning(ATROPOS_BATCHES.c.lease_id)
        )
        .scalars()
        .all()
    )
    for lease_id in expired:
        log.warning("batch %s was not acknowledged in time; it will be served again", lease_id)


async def acknowledge(db: AtroposDb, lease_id: str) -> dict[str, Any]:
    return await db.write(lambda conn: _acknowledge(conn, lease_id))


def _acknowledge(conn: sa.Connection, lease_id: str) -> dict[str, Any]:
    run_state(conn, lock=True)
    columns = ATROPOS_BATCHES.c
    query = sa.select(columns.id, columns.state, columns.group_ids).where(
        ATROPOS_BATCHES.c.lease_id == lease_id
    )
    row = conn.execute(for_update(query, dialect_of(conn))).first()
    if row is None:
        raise NotFound(
            f"no batch is leased under batch_id {lease_id!r}; if its lease ran out, "
            "it has been served again",
            field="batch_id",
            code="unknown_batch",
        )
    if row.state == AtroposBatchState.ACKED:
        return {"status": "acked", "batch_id": lease_id, "duplicate": True}
    move_batch(
        conn,
        row.id,
        (AtroposBatchState.LEASED, AtroposBatchState.PENDING),
        AtroposBatchState.ACKED,
        updated_at=utcnow(),
    )
    move_groups(conn, row.group_ids, AtroposGroupState.BATCHED, AtroposGroupState.SERVED)
    drop_served_groups(conn)
    return {"status": "acked", "batch_id": lease_id, "duplicate": False}
