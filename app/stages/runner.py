"""The background stages (compression, distribution, delivery) and the loops that
run them: claim -> work -> advance, until there is nothing left, then sleep until
woken or until flush_interval_seconds has passed (the longest a missed wake-up can
delay a trace). The stages take turns in one loop, except those added `apart`
(delivery: a training job polls for minutes), which get a loop of their own so that
they never hold up compression or batching.

Every stage keeps its state in the database, so any process may die at any moment
and the next one picks the work up.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

log = logging.getLogger("atropos.worker")


class PipelineStage(Protocol):
    name: str

    async def run_once(self) -> int:
        """Do one bounded unit of work; return how many items it advanced (0 = idle)."""
        ...


class StageRunner:
    def __init__(self, flush_interval: float) -> None:
        self.stages: list[PipelineStage] = []
        self._apart: list[PipelineStage] = []
        self._every: dict[str, float] = {}  # an apart stage's longest sleep
        self._flush_interval = flush_interval
        self._wakes: list[asyncio.Event] = []
        self._tasks: list[asyncio.Task[None]] = []

    def add(
        self, *stages: PipelineStage, apart: bool = False, every: float | None = None
    ) -> None:
        """Stages in pipeline order; `apart`: in a loop of its own when started, which
        also wakes every `every` seconds (work that comes due with time, not with a
        commit: OTLP assembly)."""
        self.stages.extend(stages)
        if apart:
            self._apart.extend(stages)
            for stage in stages:
                self._every[stage.name] = every or self._flush_interval

    def wake(self) -> None:
        """Called after each ingest commit and stage move: the next stage starts now."""
        for event in self._wakes:
            event.set()

    async def drain(self) -> int:
        """Run every stage until none has work left (`--burst`). Returns items advanced."""
        return await self._drain(self.stages)

    def start(self) -> None:
        together = [stage for stage in self.stages if stage not in self._apart]
        for group in [together, *([stage] for stage in self._apart)]:
            if not group:
                continue
            event = asyncio.Event()
            self._wakes.append(event)
            name = "stages-" + "-".join(stage.name for stage in group)
            sleep = min(self._every.get(stage.name, self._flush_interval) for stage in group)
            self._tasks.append(asyncio.create_task(self._loop(group, event, sleep), name=name))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self._wakes.clear()

    async def _drain(self, stages: list[PipelineStage]) -> int:
        total = 0
        while True:
            advanced = 0
            for stage in stages:
                advanced += await self._run_stage(stage)
            total += advanced
            if advanced == 0:
                return total

    async def _loop(self, stages: list[PipelineStage], wake: asyncio.Event, sleep: float) -> None:
        while True:
            wake.clear()
            await self._drain(stages)
            try:
                await asyncio.wait_for(wake.wait(), sleep)
            except TimeoutError:
                pass

    async def _run_stage(self, stage: PipelineStage) -> int:
        try:
            return await stage.run_once()
        except Exception:
            # A stage failing on one item records that on the row itself; this is for
            # the unexpected (database gone). Log it and let the loop try again later.
            log.exception("stage %s failed; retrying after the flush interval", stage.name)
            return 0
