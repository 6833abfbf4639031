"""The background stages (compression, distribution, delivery, retention, OTLP
assembly) and the loops that run them: claim -> work -> advance, until there is
nothing left, then sleep until woken or until flush_interval_seconds has passed (the
longest a missed wake-up can delay a trace; a stage whose work comes due with time
sleeps less). Each stage runs in a loop of its own, so that none waits for another:
batches form while summaries are being written, and a training job that
polls for minutes holds up nothing.

A stage may keep work in flight past `run_once` (compression's model calls); it is
then `Concurrent`, and `drain` (`--burst`) waits for that work too.

Every stage keeps its state in the database, so any process may die at any moment
and the next one picks the work up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable

from app.config import HubConfig
from app.errors import Unavailable
from app.outage import Outage
from app.stages import TAKES_ON
from app.waits import event_set_within

log = logging.getLogger("atropos.worker")


class PipelineStage(Protocol):
    name: str

    async def run_once(self) -> int:
        """Do one bounded unit of work; return how many items it advanced (0 = idle)."""
        ...


@runtime_checkable
class Concurrent(Protocol):
    """A stage with work in flight beyond run_once."""

    async def settle(self) -> None:
        """Wait until the work in flight is done."""
        ...

    async def close(self) -> None:
        """Abandon the work in flight (its leases run out for the next worker)."""
        ...


@runtime_checkable
class GivesWay(Protocol):
    """A stage that makes no progress while requests keep the hub busy (its work can
    wait for a quieter moment): running beside the API it gives way; drained
    (`--burst`), it does not, since draining is asking for that work now."""

    gives_way: bool


@runtime_checkable
class ComesDue(Protocol):
    """A stage whose pass takes at most `batch` items of the work due (a rollout quiet
    for long enough, traces enough for a batch, batches to deliver): a pass that
    advanced fewer took all that was due, and the next waits for a wake-up or the
    poll. Under load work comes due steadily, and passes run back to back took a few
    items each, or none, each pass paying its statements and its write turn."""

    batch: int


class StageRunner:
    def __init__(self, flush_interval: float, outage: Outage, lease_seconds: float = 30) -> None:
        """`outage`: where a stage that fails for the database's sake says so;
        `lease_seconds`: how long a claim the stages made lasts (a failed write's rows
        stay leased that long)."""
        self.stages: list[PipelineStage] = []
        self._every: dict[str, float] = {}  # a stage's longest sleep, if below flush_interval
        self._flush_interval = flush_interval
        self._outage = outage
        self._wakes: dict[str, asyncio.Event] = {}
        self._tasks: list[asyncio.Task[None]] = []
        # stage -> what the database said when its last pass failed to write. Kept apart
        # from the outage: a write elsewhere working (ingest, the write probe) does not
        # prove the stages can write (a disk with room for a small row, not for theirs).
        self._failing: dict[str, tuple[str, float]] = {}
        # A stage whose failed rows were taken by another worker never advances on them:
        # its failure lapses once they would have been claimed again and failed anew
        # (with a lease's margin, for a claim that comes late).
        self._lapse = 2 * lease_seconds + flush_interval

    @classmethod
    def of(cls, config: HubConfig, outage: Outage) -> StageRunner:
        """The runner config.json describes (trace_server.flush_interval_seconds,
        workers.lease_seconds)."""
        return cls(config.trace_server.flush_interval_seconds, outage,
                   config.workers.lease_seconds)

    @property
    def failing_writes(self) -> dict[str, str]:
        """stage -> what the database said, for each stage whose last pass failed to
        write; a stage leaves it once a pass of its own advances (one with nothing to
        claim proves nothing: the rows it failed on are still leased)."""
        now = time.monotonic()
        return {stage: said for stage, (said, at) in self._failing.items()
                if now - at < self._lapse}

    def add(self, *stages: PipelineStage, every: float | None = None) -> None:
        """Stages in pipeline order; `every`: their loop also wakes every `every`
        seconds rather than every flush interval (work that comes due with time, not
        with a commit: OTLP assembly)."""
        self.stages.extend(stages)
        if every is not None:
            for stage in stages:
                self._every[stage.name] = every

    def wake(self, *names: str) -> None:
        """Called after each ingest commit and stage move: the next stage starts now.
        `names`: only the stages that the commit gave work (those not running here are
        passed over); by default every stage."""
        if not names:
            names = tuple(self._wakes)
        for name in names:
            if (event := self._wakes.get(name)) is not None:
                event.set()

    def take_on(self, entered: Iterable[str]) -> None:
        """Wake the stages that take on traces which entered these stages (TAKES_ON),
        for an ingest commit: each stage woken pays a claim in the writer's turn, for
        nothing if the commit gave it no trace."""
        names = {TAKES_ON[stage] for stage in entered if stage in TAKES_ON}
        if names:
            self.wake(*names)

    def waking(self, *names: str) -> Callable[[], None]:
        """A wake-up of these stages alone, for a commit that gives work to them only:
        every stage's pass after each commit was paid (a claim, a write turn on SQLite)
        by the stages with nothing to do."""
        return lambda: self.wake(*names)

    async def drain(self) -> int:
        """Run every stage until none has work left, in flight included (`--burst`).
        Returns items advanced."""
        total = 0
        yielding: list[GivesWay] = [
            s for s in self.stages if isinstance(s, GivesWay) and s.gives_way]
        for giving in yielding:
            giving.gives_way = False
        try:
            while True:
                advanced = 0
                for stage in self.stages:
                    advanced += max(0, await self._run_stage(stage))
                    if isinstance(stage, Concurrent):
                        await stage.settle()
                total += advanced
                if advanced == 0:
                    return total
        finally:
            for giving in yielding:
                giving.gives_way = True

    def start(self) -> None:
        for stage in self.stages:
            event = self._wakes[stage.name] = asyncio.Event()
            self._tasks.append(asyncio.create_task(self._loop(stage, event),
                                                   name=f"stage-{stage.name}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self._wakes.clear()
        for stage in self.stages:
            if isinstance(stage, Concurrent):
                await stage.close()

    async def _loop(self, stage: PipelineStage, wake: asyncio.Event) -> None:
        sleep = min(self._every.get(stage.name, self._flush_interval), self._flush_interval)
        while True:
            wake.clear()
            while (advanced := await self._run_stage(stage)) > 0:
                if isinstance(stage, ComesDue) and advanced < stage.batch:
                    break
            if await event_set_within(
                wake, min(sleep, _PASSING_SECONDS) if advanced < 0 else sleep
            ):
                # Woken by a commit, which under load comes every few milliseconds: the
                # wake-ups of the next moment are gathered into one pass, so that a pass
                # moves many rows and an idle one (a statement, a write lock on
                # SQLite) is not paid per commit.
                await asyncio.sleep(_GATHER_SECONDS)

    async def _run_stage(self, stage: PipelineStage) -> int:
        """Items advanced; -1 after a failure that passes by itself (an ingest process
        stopped mid-pass: said by its own outage), which is retried soon."""
        try:
            advanced = await stage.run_once()
        except Unavailable as exc:
            log.info("stage %s: %s; retrying in %g s", stage.name, exc.message,
                     _PASSING_SECONDS)
            return -1
        except Exception as exc:
            # A stage failing on one item records that on the row itself; this is the
            # database failing (said once per kind), or a bug (with its traceback). The
            # loop tries again after the flush interval.
            if self._outage.failed(exc, f"running the {stage.name} stage"):
                self._failing[stage.name] = (self._outage.failing or type(exc).__name__,
                                             time.monotonic())
            else:
                log.exception("stage %s failed; retrying after the flush interval", stage.name)
            return 0
        if advanced:  # it wrote: the database works (a pass with nothing to do proves nothing)
            self._failing.pop(stage.name, None)
            self._outage.works()
        return advanced


# How soon a stage tries again after a failure that passes by itself.
_PASSING_SECONDS = 1.0
# How long a woken stage waits for more wake-ups before its pass: each pass holds the
# database's write turn (SQLite's one writer, shared with ingest) for a cost of its own
# besides its rows, so fewer, fuller passes leave ingest more of it. A trace's way
# through the stages (about three) stays well under a second.
_GATHER_SECONDS = 0.2
