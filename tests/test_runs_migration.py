"""The runs revision goes up and down on both databases without touching traces."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from app.config import TraceServerConfig
from app.db import migrate
from app.db.engine import create_engine


async def test_runs_tables_come_and_go_with_their_revision(trace_server: dict[str, Any]) -> None:
    engine = create_engine(TraceServerConfig.model_validate(trace_server))
    try:
        await migrate.upgrade(engine)
        assert {"runs", "run_processes"} <= await _tables(engine)
        await migrate.downgrade(engine, "0005-1")
        tables = await _tables(engine)
        assert "traces" in tables and not {"runs", "run_processes"} & tables
        await migrate.upgrade(engine)
        assert {"runs", "run_processes"} <= await _tables(engine)
    finally:
        await engine.dispose()


async def _tables(engine: Any) -> set[str]:
    async with engine.connect() as conn:
        return set(await conn.run_sync(lambda c: sa.inspect(c).get_table_names()))
