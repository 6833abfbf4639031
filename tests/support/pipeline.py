"""Driving traces through the stages of a hub under test: ingest over HTTP, and rewards
set directly in its database (so the tests of the later stages do not depend on the
reward rules)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import migrate
from app.db.models import PAYLOADS, TRACES
from app.db.types import utcnow
from tests.support.builders import native_trace
from tests.support.databases import database


def ingest(client: httpx.Client, trace_ids: list[str], **overrides: Any) -> None:
    """One request per trace, in order, so created_at follows the list."""
    for trace_id in trace_ids:
        r = client.post("/v1/traces", json=native_trace(trace_id=trace_id, **overrides))
        assert r.status_code == 202, r.text


async def set_rewards(trace_server: dict[str, Any], rewards: dict[str, float]) -> None:
    async with database(trace_server) as engine, engine.begin() as conn:
        for trace_id, reward in rewards.items():
            await conn.execute(
                sa.update(TRACES).where(TRACES.c.trace_id == trace_id).values(reward=reward)
            )


@asynccontextmanager
async def migrated(trace_server: dict[str, Any]) -> AsyncIterator[AsyncEngine]:
    """The test database at the current schema, for tests that run a stage in-process."""
    async with database(trace_server) as engine:
        await migrate.upgrade(engine)
        yield engine


async def insert_trace(
    engine: AsyncEngine, trace_id: str, stage: str, *, trace: dict[str, Any] | None = None
) -> None:
    """A stored trace in `stage`, as the stages leave it (no ingest needed)."""
    body = trace if trace is not None else {"task": "t", "steps": [{"type": "final"}]}
    now = utcnow()
    async with engine.begin() as conn:
        await conn.execute(sa.insert(TRACES).values(
            trace_id=trace_id, created_at=now, updated_at=now, status="success",
            stage=stage, total_tokens=10, source_format="native", content_hash=trace_id,
        ))
        await conn.execute(sa.insert(PAYLOADS).values(trace_id=trace_id, original=body,
                                                      trace=body))


async def stages(engine: AsyncEngine) -> dict[str, str]:
    async with engine.connect() as conn:
        rows = await conn.execute(sa.select(TRACES.c.trace_id, TRACES.c.stage))
        return {trace_id: stage for trace_id, stage in rows}
