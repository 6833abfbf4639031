"""Periodic tasks (retention) shared by every hub process on one database: a task runs
when its last start is older than its period, and the process that moves
`last_started_at` forward (one conditional UPDATE) is the one that runs it. A
restart does not run it early; a crash mid-run waits for the next period."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db.dialect import dialect_of, insert_ignoring_conflicts
from app.db.models import SCHEDULED_TASKS as TASKS
from app.db.types import utcnow

_NEVER = datetime(1970, 1, 1, tzinfo=UTC)


async def claim_if_due(engine: AsyncEngine, name: str, every: timedelta) -> bool:
    """True if `name` is due and this process now owns this period's run."""
    now = utcnow()
    async with engine.begin() as conn:
        insert = insert_ignoring_conflicts(dialect_of(conn), TASKS, "name")
        await conn.execute(insert.values(name=name, last_started_at=_NEVER))
        moved = await conn.execute(
            sa.update(TASKS)
            .where(TASKS.c.name == name, TASKS.c.last_started_at <= now - every)
            .values(last_started_at=now)
        )
        return moved.rowcount == 1


async def record_result(engine: AsyncEngine, name: str, result: dict[str, Any]) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            sa.update(TASKS)
            .where(TASKS.c.name == name)
            .values(last_finished_at=utcnow(), last_result=result)
        )
