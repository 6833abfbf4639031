"""Driving traces through the stages of a hub under test: ingest over HTTP, and rewards
set directly in its database (so the tests of the later stages do not depend on the
reward rules)."""

from __future__ import annotations

from typing import Any

import httpx
import sqlalchemy as sa

from app.db.models import TRACES
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
