"""Reading batches back (list, one with its traces, counts) and re-queueing a failed one."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.db.models import BATCHES, MEMBERS
from app.db.moves import BATCH_STATES, RELEASED
from app.db.trace_queries import newest_first
from app.domain import BatchState
from app.errors import Conflict, NotFound

COLUMNS = tuple(c for c in BATCHES.c if c.name not in ("lease_owner", "lease_expires_at"))


async def list_batches(
    conn: AsyncConnection, state: BatchState | None, limit: int, cursor: str | None
) -> tuple[list[dict[str, Any]], str | None]:
    """Newest first, paged like /v1/traces."""
    query = sa.select(*COLUMNS)
    if state is not None:
        query = query.where(BATCHES.c.state == state.value)
    rows, next_cursor = await newest_first(conn, query, BATCHES, limit, cursor)
    return [_record(row._mapping) for row in rows], next_cursor


async def get_batch(conn: AsyncConnection, batch_id: str) -> dict[str, Any]:
    row = (await conn.execute(sa.select(*COLUMNS).where(BATCHES.c.batch_id == batch_id))).first()
    if row is None:
        raise NotFound(f"no batch with batch_id {batch_id!r}", field="batch_id")
    members = await conn.execute(
        sa.select(MEMBERS.c.trace_id)
        .where(MEMBERS.c.batch_id == batch_id)
        .order_by(MEMBERS.c.position)
    )
    return {**_record(row._mapping), "trace_ids": list(members.scalars())}


async def retry_batch(engine: AsyncEngine, batch_id: str) -> dict[str, Any]:
    """A failed batch becomes pending again with its attempts reset; its receipt and
    last_error stay (a training job is resumed, not started twice)."""
    async with engine.begin() as conn:
        moved = await conn.execute(
            BATCH_STATES.move(BatchState.PENDING, expected=[BatchState.FAILED])
            .where(BATCHES.c.batch_id == batch_id)
            .values(attempts=0, **RELEASED)
        )
        if moved.rowcount == 1:
            return await get_batch(conn, batch_id)
        current = await get_batch(conn, batch_id)  # NotFound for an unknown id
    raise Conflict(
        f"batch {batch_id} is {current['state']}, not failed: only a failed batch is retried",
        field="batch_id",
    )


async def retry_failed_batches(engine: AsyncEngine) -> list[str]:
    """Every failed batch pending again, as retry_batch makes one; their ids."""
    async with engine.begin() as conn:
        moved = await conn.execute(
            BATCH_STATES.move(BatchState.PENDING, expected=[BatchState.FAILED])
            .values(attempts=0, **RELEASED)
            .returning(BATCHES.c.batch_id)
        )
        return sorted(moved.scalars())


def _record(row: Any) -> dict[str, Any]:
    def iso(value: Any) -> str | None:
        return value.isoformat() if value is not None else None

    return {
        "batch_id": row["batch_id"],
        "state": row["state"],
        "size": row["size"],
        "target": row["target"],
        "format": row["format"],
        "attempts": row["attempts"],
        "last_error": row["last_error"],
        "created_at": iso(row["created_at"]),
        "updated_at": iso(row["updated_at"]),
        "delivered_at": iso(row["delivered_at"]),
        "receipt": row["receipt"],
    }
