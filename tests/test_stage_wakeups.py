"""An ingest commit, and a trajectory assembled, wake only the stages that take their
traces on: each stage woken pays a claim in the writer's turn. A stage whose work comes
due with time takes it in passes of many."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from app.config import EnvironmentConfig, LimitsConfig
from app.domain import Stage
from app.evaluation.environment import Environment
from app.ingest.ingestor import Preparer
from app.ingest.inserter import PreparedTrace
from app.outage import Outage
from app.stages import COMPRESSION, DELIVERY, DISTRIBUTION
from app.stages.assembly import Written
from app.stages.runner import StageRunner
from tests.support.builders import native_trace
from tests.support.waiting import wait_until_async


class _Counted:
    """A stage that counts its passes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.passes = 0

    async def run_once(self) -> int:
        self.passes += 1
        return 0


async def test_an_ingest_commit_wakes_only_the_stages_its_traces_need() -> None:
    compression, distribution, delivery = (_Counted(n) for n in (COMPRESSION, DISTRIBUTION,
                                                                 DELIVERY))
    # No stage passes again by itself within the test: only a wake-up starts a pass.
    runner = StageRunner(flush_interval=3600, outage=Outage("the database", "nothing"))
    runner.add(compression, distribution, delivery)
    runner.start()
    try:
        stages = (compression, distribution, delivery)
        await wait_until_async(lambda: all(s.passes == 1 for s in stages),
                               what="each stage's first pass")
        # Traces compression had nothing to do with (or compressed at ingest) go to
        # distribution; rejected and below-threshold ones to no stage.
        runner.take_on([Stage.COMPRESSION_SKIPPED.value, Stage.REJECTED.value,
                        Stage.BELOW_THRESHOLD.value])
        await wait_until_async(lambda: distribution.passes == 2, what="distribution woken")
        runner.take_on([Stage.REJECTED.value, Stage.BELOW_THRESHOLD.value])  # none woken
        runner.take_on([Stage.ACCEPTED.value, Stage.ACCEPTED.value])
        await wait_until_async(lambda: compression.passes == 2, what="compression woken")
        runner.take_on([Stage.COMPRESSED.value])
        await wait_until_async(lambda: distribution.passes == 3, what="distribution woken")
        assert (compression.passes, distribution.passes, delivery.passes) == (2, 3, 1)
    finally:
        await runner.stop()


class _ComingDue:
    """A stage whose work comes due with time, `batch` items a pass at most; while a
    pass runs, `arriving` more come due."""

    name = "rollouts"

    def __init__(self, due: int, batch: int, arriving: int) -> None:
        self.due, self.batch, self.arriving = due, batch, arriving
        self.taken: list[int] = []

    async def run_once(self) -> int:
        await asyncio.sleep(0)  # a pass waits for its statements
        taken = min(self.due, self.batch)
        self.due += self.arriving - taken
        self.taken.append(taken)
        return taken


async def test_work_that_comes_due_steadily_is_taken_in_passes_of_many() -> None:
    """Passes back to back while each finds some due took a few items each (a pass's
    statements paid per few rollouts, under load); a pass that took fewer than its
    batch took all there was, and the next waits for the stage's poll or a wake-up."""
    stage = _ComingDue(due=25, batch=10, arriving=2)
    runner = StageRunner(flush_interval=3600, outage=Outage("the database", "nothing"))
    runner.add(stage)
    runner.start()
    try:
        # Full passes go on at once; the one that took fewer ends the run of passes.
        await wait_until_async(lambda: len(stage.taken) >= 3, what="the first passes")
        assert stage.taken == [10, 10, 9] and stage.due == 2
        runner.wake(stage.name)
        await wait_until_async(lambda: len(stage.taken) >= 4, what="the next pass")
        assert stage.taken == [10, 10, 9, 2]  # what came due meanwhile, in one pass
    finally:
        await runner.stop()


def test_a_trajectory_made_wakes_the_stages_that_take_it_on() -> None:
    """Assembled trajectories (OTLP, gateway rollouts) wake the stage after the one
    they entered, not every stage (the assembly stages themselves included)."""
    preparer = Preparer(Environment.from_config(EnvironmentConfig()), LimitsConfig())
    made = PreparedTrace.of(preparer.row(native_trace(trace_id="made")))
    again = PreparedTrace.of(preparer.row(native_trace(trace_id="again")))
    woken: list[list[str]] = []

    def take_on(entered: Iterable[str]) -> None:
        woken.append(list(entered))

    written = Written([("new", None), ("replaced", None)], {"made"},
                      {"made": made, "again": again})
    written.report(logging.getLogger("test"), "2 traces", "native", take_on)
    assert woken == [[made.stage, Stage.ACCEPTED.value]]
    woken.clear()
    Written([("unchanged", None)], set(), {"again": again}).report(
        logging.getLogger("test"), "1 trace", "native", take_on)
    assert woken == []
