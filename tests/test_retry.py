"""One retry policy for the background stages: a failed attempt keeps its lease,
shortened to the backoff; after the last attempt the row is failed with its error.
Unexpected failures are logged with their traceback, expected ones in one line."""

from __future__ import annotations

import asyncio
import logging
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from app.config import CompressionConfig, DeliveryRetry, RetryPolicy, TraceServerConfig
from app.db.engine import create_engine
from app.db.models import TRACES
from app.db.moves import TRACE_STAGES
from app.db.types import utcnow
from app.domain import Stage
from app.errors import Unavailable
from app.ingest.inserter import Stored, TraceInserter, TraceRow
from app.stages.compression import CompressionStage
from app.stages.leases import Lease, claim, retry_later
from tests.support.databases import create_pg_database, drop_pg_database
from tests.support.pipeline import insert_trace, migrated, stages
from tests.support.waiting import wait_until_async


def test_the_default_backoffs() -> None:
    # Compression: 5 s, then 10 s (what its fixed 5 s x attempt was), at most 3 attempts.
    compression = CompressionConfig().retry
    assert (compression.max_attempts, compression.delay(1), compression.delay(2)) == (3, 5, 10)
    assert RetryPolicy(base_seconds=5, max_seconds=60).delay(10) == 60
    # Delivery: jittered down by at most half, never over the cap.
    delivery = DeliveryRetry()
    assert delivery.max_attempts == 6
    assert all(2.5 <= delivery.delay(1) <= 5 and 30 <= delivery.delay(9) <= 60
               for _ in range(200))


async def _claim(engine: Any, lease: Lease) -> list[Any]:
    async with engine.begin() as conn:
        return await claim(
            conn, TRACES, where=TRACES.c.stage == Stage.ACCEPTED.value,
            order_by=TRACES.c.created_at, limit=1, lease=lease,
            returning=[TRACES.c.trace_id, TRACES.c.attempts],
        )


async def _defer(engine: Any, lease: Lease, attempts: int, policy: RetryPolicy) -> float | None:
    async with engine.begin() as conn:
        return await retry_later(
            conn, TRACES, "t-1", attempts, lease=lease, policy=policy,
            give_up=TRACE_STAGES.move(Stage.COMPRESSION_FAILED, expected=[Stage.ACCEPTED]),
            stage_error=f"boom {attempts}",
        )


async def _row(engine: Any) -> Any:
    async with engine.connect() as conn:
        return (await conn.execute(sa.select(TRACES).where(TRACES.c.trace_id == "t-1"))).one()


async def test_a_failed_attempt_waits_out_its_backoff_then_gives_up(
    trace_server: dict[str, Any],
) -> None:
    policy = RetryPolicy(max_attempts=2, base_seconds=30)
    mine, other = Lease(), Lease()
    async with migrated(trace_server) as engine:
        await insert_trace(engine, "t-1", Stage.ACCEPTED)
        assert [r.attempts for r in await _claim(engine, mine)] == [1]
        assert await _defer(engine, mine, 1, policy) == 30
        row = await _row(engine)
        assert (row.stage, row.stage_error, row.lease_owner) == ("accepted", "boom 1", mine.owner)
        assert timedelta(seconds=25) < row.lease_expires_at - utcnow() <= timedelta(seconds=30)
        assert await _claim(engine, other) == []  # still backing off

        # The backoff has passed: any worker claims it for the last attempt.
        async with engine.begin() as conn:
            await conn.execute(sa.update(TRACES).values(lease_expires_at=utcnow()))
        assert [r.attempts for r in await _claim(engine, other)] == [2]
        assert await _defer(engine, mine, 2, policy) is None  # no longer mine: nothing written
        assert (await _row(engine)).stage == "accepted"
        assert await _defer(engine, other, 2, policy) is None
        row = await _row(engine)
        assert (row.stage, row.stage_error) == ("compression_failed", "boom 2")
        assert (row.lease_owner, row.lease_expires_at) == (None, None)


async def test_a_backward_clock_step_holds_a_lease_no_longer_than_the_lease(
    trace_server: dict[str, Any],
) -> None:
    """A dead worker's lease, taken before the clock stepped back ten minutes: its
    expiry is ten minutes further off than a lease lasts. Claimable once a lease has
    passed, not once the clock has caught up."""
    dead, live = Lease(seconds=1), Lease(seconds=1)
    async with migrated(trace_server) as engine:
        await insert_trace(engine, "t-1", Stage.ACCEPTED)
        async with engine.begin() as conn:
            await conn.execute(sa.update(TRACES).values(
                lease_owner=dead.owner, lease_expires_at=utcnow() + timedelta(minutes=10)))
        assert await _claim(engine, live) == []
        assert (await _row(engine)).lease_expires_at - utcnow() <= timedelta(seconds=1)
        claimed = await wait_until_async(lambda: _claim(engine, live), timeout=10,
                                         what="the lease claimable")
        assert [r.trace_id for r in claimed] == ["t-1"]


async def test_compression_retries_a_failing_trace_then_marks_it_failed(
    trace_server: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    # A stored trace the strategy cannot read: a bug, not a model failure.
    policy = CompressionConfig(retry=RetryPolicy(max_attempts=2, base_seconds=0))
    async with migrated(trace_server) as engine:
        await insert_trace(engine, "t-1", Stage.ACCEPTED, trace={"not a trace": True})
        stage = CompressionStage(engine, policy, max_trace_tokens=50_000, lease=Lease())
        with caplog.at_level(logging.WARNING, "atropos.compression"):
            assert await stage.run_once() == 1
            assert await stages(engine) == {"t-1": "accepted"}
            assert await stage.run_once() == 1
        assert await stages(engine) == {"t-1": "compression_failed"}
        assert "ValidationError" in (await _row(engine)).stage_error
        attempts = [r for r in caplog.records if r.name == "atropos.compression"]
        assert ["attempt 1 of 2" in r.getMessage() for r in attempts] == [True, False]
        assert "giving up" in attempts[1].getMessage()
        assert all(r.exc_info for r in attempts)


async def test_the_inserter_logs_a_bug_with_its_traceback_and_a_refusal_in_one_line(
    trace_server: dict[str, Any], dialect: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with migrated(trace_server) as engine:
        inserter = TraceInserter(engine)
        inserter.start()
        try:
            with caplog.at_level(logging.ERROR, "atropos.ingest"), pytest.raises(Unavailable):
                # No values at all: the insert's own code fails (a bug, not the database).
                await inserter.insert(TraceRow(None, "", _answer("t-0"), "hash"))  # type: ignore[arg-type]
        finally:
            await inserter.stop()
    [bug] = [r for r in caplog.records if r.name == "atropos.ingest"]
    assert bug.exc_info is not None and bug.exc_info[0] is TypeError

    caplog.clear()
    if dialect == "sqlite":
        directory = Path(trace_server["db_path"]).parent / "gone"
        gone = {**trace_server, "db_path": str(directory / "traces.db")}
    else:
        url = await asyncio.to_thread(create_pg_database)
        await asyncio.to_thread(drop_pg_database, url)
        gone = {**trace_server, "database_url": url}
    engine = create_engine(TraceServerConfig(**gone))
    if dialect == "sqlite":
        shutil.rmtree(directory)  # the file and its directory, gone before the first write
    inserter = TraceInserter(engine)
    inserter.start()
    try:
        with caplog.at_level(logging.ERROR, "atropos"), pytest.raises(Unavailable):
            await inserter.insert(TraceRow(("t-1",), "", _answer("t-1"), "hash"))
        with pytest.raises(Unavailable):
            await inserter.insert(TraceRow(("t-2",), "", _answer("t-2"), "hash"))
    finally:
        await inserter.stop()
        await engine.dispose()
    # Said once (its kind, what was being done, what the database said), not per write.
    [refused] = [r for r in caplog.records if r.name.startswith("atropos")]
    assert refused.name == "atropos.database" and refused.exc_info is None
    assert refused.getMessage().startswith("the database is failing (")
    assert "while storing traces" in refused.getMessage()
    assert "\n" not in refused.getMessage() and "INSERT" not in refused.getMessage()


def _answer(trace_id: str) -> Stored:
    return Stored(trace_id, "accepted", "success", 1, 0.0, None, None, None)
