"""Helpers for tests that drive traces through the background stages: a database
handle on the hub's own database, rewards set directly (so the tests do not depend on
the reward rules), and polling."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import httpx
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import TraceServerConfig
from app.db import migrate
from app.db.engine import create_engine
from app.db.models import TRACES
from app.db.types import utcnow
from tests.conftest import native_trace

T = TypeVar("T")


@asynccontextmanager
async def database(trace_server: dict[str, Any]) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(TraceServerConfig.model_validate(trace_server))
    try:
        yield engine
    finally:
        await engine.dispose()


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
            original=body, trace=body,
        ))


async def stages(engine: AsyncEngine) -> dict[str, str]:
    async with engine.connect() as conn:
        rows = await conn.execute(sa.select(TRACES.c.trace_id, TRACES.c.stage))
        return {trace_id: stage for trace_id, stage in rows}


async def set_rewards(trace_server: dict[str, Any], rewards: dict[str, float]) -> None:
    async with database(trace_server) as engine, engine.begin() as conn:
        for trace_id, reward in rewards.items():
            await conn.execute(
                sa.update(TRACES).where(TRACES.c.trace_id == trace_id).values(reward=reward)
            )


def ingest(client: httpx.Client, trace_ids: list[str], **overrides: Any) -> None:
    """One request per trace, in order, so created_at follows the list."""
    for trace_id in trace_ids:
        r = client.post("/v1/traces", json=native_trace(trace_id=trace_id, **overrides))
        assert r.status_code == 202, r.text


def wait_until(check: Callable[[], T], timeout: float = 30, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last value {value!r}")
        time.sleep(0.1)
