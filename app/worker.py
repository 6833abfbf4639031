"""The background stages (compression, distribution, delivery) and the loop that
runs them: claim -> work -> advance, until there is nothing left, then sleep until
woken or until flush_interval_seconds has passed (the longest a missed wake-up can
delay a trace).

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
        self._flush_interval = flush_interval
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def add(self, *stages: PipelineStage) -> None:
        self.stages.extend(stages)

    def wake(self) -> None:
        """Called after each ingest commit and stage move: the next stage starts now."""
        self._wake.set()

    async def drain(self) -> int:
        """Run every stage until none has work left (`--burst`). Returns items advanced."""
        total = 0
        while True:
            advanced = 0
            for stage in self.stages:
                advanced += await self._run_stage(stage)
            total += advanced
            if advanced == 0:
                return total

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="stage-runner")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            await self.drain()
            try:
                await asyncio.wait_for(self._wake.wait(), self._flush_interval)
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
