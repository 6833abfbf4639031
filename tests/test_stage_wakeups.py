"""An ingest commit wakes only the stages that take its traces on: each stage woken
pays a claim in the writer's turn."""

from __future__ import annotations

from app.domain import Stage
from app.outage import Outage
from app.stages import COMPRESSION, DELIVERY, DISTRIBUTION
from app.stages.runner import StageRunner
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
