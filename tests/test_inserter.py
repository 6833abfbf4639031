"""The group commit (app/ingest/inserter.py) on both databases: a row the database
refuses sinks alone, whichever place it has in the batch."""

from __future__ import annotations

import asyncio
from typing import Any

import sqlalchemy as sa

from app.config import EnvironmentConfig, LimitsConfig, TraceServerConfig
from app.db import migrate
from app.db.engine import create_engine
from app.errors import Invalid
from app.evaluation.environment import Environment
from app.ingest.ingestor import Preparer
from app.ingest.inserter import Stored, TraceInserter
from tests.support.builders import native_trace

PREPARER = Preparer(Environment.from_config(EnvironmentConfig()), LimitsConfig())


async def test_a_refused_row_sinks_alone_in_its_group_commit(
    trace_server: dict[str, Any],
) -> None:
    """On PostgreSQL a refused first insert aborted the transaction, and 17 of 32 good
    traces sent beside it got 422 (issue 17). Refused first, in the middle and last."""
    engine = create_engine(TraceServerConfig(**trace_server))
    await migrate.upgrade(engine)
    inserter = TraceInserter(engine)
    inserter.start()
    try:
        good = [PREPARER.row(native_trace(trace_id=f"good-{i}")) for i in range(32)]
        # A NOT NULL column left empty: refused by both databases.
        bad = [PREPARER.row(native_trace(trace_id=f"bad-{i}")) | {"status": None}
               for i in range(3)]
        rows = [bad[0], *good[:16], bad[1], *good[16:], bad[2]]
        # Submitted without yielding to the writer: one batch, one transaction.
        waiting = [inserter.submit(row) for row in rows]
        results = await asyncio.gather(*waiting, return_exceptions=True)
        answers = dict(zip([row["trace_id"] for row in rows], results))
        for i in range(3):
            refused = answers[f"bad-{i}"]
            assert isinstance(refused, Invalid) and refused.status == 422, refused
        for i in range(32):
            stored = answers[f"good-{i}"]
            assert isinstance(stored, Stored) and not stored.duplicate, stored
        async with engine.connect() as conn:
            count = await conn.scalar(sa.text("SELECT count(*) FROM traces"))
        assert count == 32
    finally:
        await inserter.stop()
        await engine.dispose()
