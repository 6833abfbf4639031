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

from app.config import (
    CompressionConfig,
    DeliveryRetry,
    EnvironmentConfig,
    LimitsConfig,
    OtlpConfig,
    RetryPolicy,
    TraceServerConfig,
)
from app.db.engine import create_engine
from app.db.models import TRACES
from app.db.moves import TRACE_STAGES
from app.db.types import utcnow
from app.domain import Stage
from app.errors import Unavailable
from app.evaluation.environment import Environment
from app.ingest.ingestor import Preparer
from app.ingest.inserter import PreparedTrace, TraceInserter
from app.outage import Outage
from app.stages.assembly import BACKOFF_MAX_SECONDS, AssemblyStage
from app.stages.compression import CompressionStage
from app.stages.leases import Lease, claim, retry_later
from app.stages.runner import StageRunner
from tests.support.builders import native_trace
from tests.support.clock import Clock
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
        rows = await conn.run_sync(
            claim, TRACES, where=TRACES.c.stage == Stage.ACCEPTED.value,
            order_by=TRACES.c.created_at, limit=1, lease=lease,
            returning=[TRACES.c.trace_id, TRACES.c.attempts],
        )
        return list(rows)


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
            with caplog.at_level(logging.ERROR, "atropos.database"), pytest.raises(Unavailable):
                # No values at all: the insert's own code fails (a bug, not the database).
                await inserter.insert(PreparedTrace(None, (), ""))  # type: ignore[arg-type]
        finally:
            await inserter.stop()
    [bug] = [r for r in caplog.records if r.name == "atropos.database"]
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
            await inserter.insert(_prepared("t-1"))
        with pytest.raises(Unavailable):
            await inserter.insert(_prepared("t-2"))
    finally:
        await inserter.stop()
        await engine.dispose()
    # Said once (its kind, what was being done, what the database said), not per write.
    [refused] = [r for r in caplog.records if r.name.startswith("atropos")]
    assert refused.name == "atropos.database" and refused.exc_info is None
    assert refused.getMessage().startswith("the database is failing (")
    assert "while storing traces" in refused.getMessage()
    assert "\n" not in refused.getMessage() and "INSERT" not in refused.getMessage()


def _prepared(trace_id: str) -> PreparedTrace:
    preparer = Preparer(Environment.from_config(EnvironmentConfig()), LimitsConfig())
    return PreparedTrace.of(preparer.row(native_trace(trace_id=trace_id)))


async def test_a_failing_assembly_pass_is_tried_again_later_each_time(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A pass that fails (a bug on one trace, the database) waits 1 s, then twice as long
    each time, up to BACKOFF_MAX_SECONDS: a failure that lasts costs little. A pass that
    works ends the backoff."""
    clock = Clock()
    clock.now = 0.0
    engine = create_engine(TraceServerConfig(db_path=str(tmp_path / "never-opened.db")))
    stage = AssemblyStage(engine, OtlpConfig(), _never_prepared, clock=clock)
    passes: list[float] = []
    failing = [True]

    async def one_pass() -> int:
        passes.append(clock.now)
        if failing[0]:
            raise RuntimeError("a pass that fails")
        return 1

    monkeypatch.setattr(stage, "_pass", one_pass)
    for quarter in range(4 * 80):  # 80 s, a pass looked for every quarter of a second
        clock.now = quarter / 4
        try:
            await stage.run_once()
        except RuntimeError:
            pass
    assert passes == [0, 1, 3, 7, 15, 31, 31 + BACKOFF_MAX_SECONDS]
    failing[0] = False
    clock.now = passes[-1] + BACKOFF_MAX_SECONDS
    assert await stage.run_once() == 1
    assert await stage.run_once() == 1  # at once: the backoff ended with the pass that worked
    await engine.dispose()


async def _never_prepared(items: list[Any], source: str | None) -> list[Any]:
    raise AssertionError("not called: the passes are the test's")


async def test_a_stage_failing_for_a_passing_reason_is_said_in_one_line_and_tried_soon(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An ingest process killed during assembly: no traceback, and the stage tries again
    within a second or so, not after the flush interval (an hour here)."""
    calls: list[float] = []
    again = asyncio.Event()

    class Stopped:
        name = "assembly"

        async def run_once(self) -> int:
            calls.append(asyncio.get_running_loop().time())
            if len(calls) == 1:
                raise Unavailable("an ingest process stopped while it held this pass")
            again.set()
            return 0

    runner = StageRunner(flush_interval=3600, outage=Outage("the database", "nothing"))
    runner.add(Stopped())
    with caplog.at_level(logging.INFO, "atropos"):
        runner.start()
        try:
            await asyncio.wait_for(again.wait(), 30)
        finally:
            await runner.stop()
    [said] = [r for r in caplog.records if r.name == "atropos.worker"]
    assert said.levelno == logging.INFO and said.exc_info is None
    assert said.getMessage() == ("stage assembly: an ingest process stopped while it held "
                                 "this pass; retrying in 1 s")
