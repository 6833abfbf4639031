"""The objects one hub process lives by, built from the config files: the engine,
the ingest path (inserter, ingestor) and the background stages (wired in
app/stages/pipeline.py). `atropos serve` owns all of them through the API's lifespan;
`atropos worker` only the stages."""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine

from app.access.guard import Access
from app.atropos import Atropos
from app.config import HubConfig, Settings
from app.db.dialect import OneHop
from app.db.errors import outage_of
from app.db.group_commit import GroupCommit
from app.db.migrate import open_database
from app.db.schedule import claim_if_due
from app.evaluation.environment import Environment
from app.ingest.ingestor import EntryStage, Ingestor, ingest_processes, running_ingest
from app.ingest.inserter import TraceInserter
from app.ingest.otlp.receiver import SpanReceiver
from app.ingest.processes import ingest_outage
from app.llm import model_outage
from app.metrics import summarizing
from app.outage import Outages, training_outage
from app.stages.runner import StageRunner
from app.tokens import encoding

if TYPE_CHECKING:
    from app.gateway.service import Gateway
    from app.runs.supervisor import RunSupervisor

log = logging.getLogger("atropos")


@dataclass
class Hub:
    settings: Settings
    engine: AsyncEngine
    # The one write connection (on SQLite one thread) every group commit shares.
    writer: OneHop
    outages: Outages
    inserter: TraceInserter
    ingestor: Ingestor
    stages: StageRunner
    access: Access
    atropos: Atropos
    spans: SpanReceiver  # OTLP/HTTP traces
    # Training runs (app/runs); None unless config.json's runs.enabled is true.
    runs: RunSupervisor | None = None
    # The model endpoint (app/gateway); None unless gateway.enabled is true.
    gateway: Gateway | None = None
    _probe: asyncio.Task[None] | None = field(default=None, init=False, repr=False)

    @property
    def config(self) -> HubConfig:
        return self.settings.config

    @property
    def group_commits(self) -> list[GroupCommit[Any, Any]]:
        """Every writer that answers requests once it committed."""
        commits: list[GroupCommit[Any, Any]] = [
            self.inserter.commits, self.spans.commits, self.atropos.commits]
        return commits if self.gateway is None else [*commits, self.gateway.commits]

    def write_problem(self) -> str | None:
        """Why the hub is not taking writes now (for /readyz), or None: a writer's
        transaction running past limits.max_write_wait_seconds, a stage whose last pass
        failed to write, or the database failing for any writer. Then a probe write (at
        most one at a time) finds out when it works again, without traffic to prove it."""
        max_wait = self.config.limits.max_write_wait_seconds
        for commits in self.group_commits:
            if (waited := commits.write_wait()) > max_wait:
                return (f"no write of {commits.kind.name} has finished for {waited:.1f} s "
                        f"(limits.max_write_wait_seconds is {max_wait:g})")
        for stage, said in self.stages.failing_writes.items():
            # Its own next pass tells when it writes again; a probe would not.
            return f"the {stage} stage failed to write: {said}"
        failing = self.outages.database.failing
        if failing is None:
            return None
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._probe_write(), name="write-probe")
        return f"the last write failed: {failing}"

    async def _probe_write(self) -> None:
        """One small write of the hub's own: the `write_probe` row of scheduled_tasks."""
        try:
            await claim_if_due(self.engine, "write_probe", timedelta(0))
        except Exception as exc:
            if not self.outages.database.failed(exc, "probing whether writes work"):
                log.exception("the write probe failed")
        else:
            self.outages.database.works()


def entry_stage(settings: Settings) -> EntryStage:
    """Where accepted traces enter the pipeline, by the compression policy and the
    distributor's threshold the stages go by."""
    config = settings.config
    return EntryStage(settings.compression.compression, config.trace_server.max_trace_tokens,
                      config.distributor.min_reward_threshold)


def hub_outages(engine: AsyncEngine, settings: Settings) -> Outages:
    """The outage reporters of one hub process (app/outage.py)."""
    return Outages(
        database=outage_of(engine),
        ingest=ingest_outage(),
        model=model_outage(settings.compression.compression),
        training=training_outage(),
    )


@asynccontextmanager
async def running_gateway(settings: Settings, engine: AsyncEngine, writer: OneHop,
                          outages: Outages) -> AsyncIterator[Gateway | None]:
    """The gateway, with its HTTP client to the upstreams (connections bounded only by
    the hub's own, trace_server.max_connections) and its captures' group commit, when
    gateway.enabled is true."""
    config = settings.config
    if not config.gateway.enabled:
        yield None
        return
    # Imported only when enabled: its HTTP client (aiohttp) weighs on every start.
    from app.gateway.service import Gateway
    from app.gateway.upstream import Upstreams
    from app.gateway.writer import CallWriter

    upstreams = Upstreams(config.trace_server.max_connections,
                          settings.tinker.tinker.timeout_seconds)
    upstreams.start()
    limits = config.limits
    captures = CallWriter(writer, outages.database, max_wait=limits.max_write_wait_seconds,
                          retry_after=limits.retry_after_seconds)
    captures.start()
    try:
        yield Gateway(engine, config.gateway, settings.tinker.tinker, config.privacy,
                      upstreams, captures, limits.retry_after_seconds)
    finally:
        await captures.close()
        await upstreams.close()


@asynccontextmanager
async def running_hub(
    settings: Settings,
    environment: Environment,
    *,
    engine: AsyncEngine | None = None,
    workers: bool = True,
    answering: asyncio.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[Hub]:
    """The hub, serving. `answering`, when given, is set by the caller once the server
    answers HTTP: only then are the background stages imported and built, the tokenizer
    loaded and the ingest processes started, so that a restarted hub answers within a
    second (atroposlib's envs give up after three tries in 1.5-3 s). A trace that
    arrives earlier starts the processes itself and waits for them; `hub.stages` exists
    from the start and runs no stage until then. Without `answering` all is built before the hub is
    yielded. `clock`: monotonic seconds for the rate limits (a test's own, to move it)."""
    engine = engine or await open_database(settings.config)
    writer = OneHop(engine)
    outages = hub_outages(engine, settings)
    stages = StageRunner.of(settings.config, outages.database)
    # Started by _start_background.
    processes = ingest_processes(settings.config, environment, outages.ingest,
                                 start_wait=settings.config.limits.max_write_wait_seconds,
                                 entry=entry_stage(settings))
    try:
        config = settings.config
        async with (
            summarizing(config.trace_server.log_summary_seconds),
            # The stages' context (app/stages/pipeline.py), entered now or in the
            # background: it ends after the ingest path, which wakes them as it commits.
            AsyncExitStack() as pipeline,
            running_ingest(
                engine, config, environment, admitted=True,
                on_commit=lambda traces: stages.take_on(t.stage for t in traces),
                processes=processes, writer=writer, outage=outages.database,
            ) as ingest,
            running_gateway(settings, engine, writer, outages) as gateway,
        ):
            access = Access(config.auth, engine, clock)
            if config.auth.enabled and not config.atropos.keys_required(config.auth):
                log.warning(
                    "auth.enabled is on but atropos.require_key is off: the Atropos API "
                    "(/register, /scored_data, /batch, ...) takes no key, so anyone who "
                    "reaches this port can add groups or take batches (docs/atropos.md)"
                )
            atropos = Atropos(
                engine, config.atropos, processes, config.privacy, writer=writer,
                outage=outages.database, max_wait=config.limits.max_write_wait_seconds,
            )
            spans = SpanReceiver(
                engine, processes, ingest.admission, config.limits, config.otlp,
                config.privacy, writer=writer, outage=outages.database,
            )
            hub = Hub(settings, engine, writer, outages, ingest.inserter, ingest.ingestor,
                      stages, access, atropos, spans, gateway=gateway)
            if gateway is not None:
                gateway.write_problem = hub.write_problem
            if answering is None:
                await _add_stages(hub, pipeline)
            atropos.start()
            spans.start()
            background = asyncio.create_task(
                _start_background(hub, pipeline, workers, answering), name="hub-background"
            )
            try:
                if config.runs.enabled:
                    from app.runs.supervisor import RunSupervisor  # where runs are enabled

                    hub.runs = RunSupervisor(engine, config.runs, settings.tinker.tinker)
                    await hub.runs.start()  # re-attaches to the runs a previous hub left
                # What exists now lives as long as the process: keep it out of the
                # collector's full passes, which otherwise walked every object of
                # the app, often under ingest load.
                gc.freeze()
                yield hub
            finally:
                background.cancel()
                await asyncio.gather(background, return_exceptions=True)
                if hub.runs is not None:
                    await hub.runs.close()  # the runs' processes keep running
                await atropos.stop()
                await spans.close()
    finally:
        await processes.close()
        await writer.close()
        await engine.dispose()


async def _add_stages(hub: Hub, pipeline: AsyncExitStack) -> None:
    """The background stages, built into `hub.stages` (not started)."""
    stages = await importing(lambda: importlib.import_module("app.stages.pipeline"))

    # Two: the second takes what the first falls behind on (a backlog's pass of 128
    # files). Started by their first call; closed once the stages have stopped.
    rendering = hub.ingestor.processes.apart(2)
    pipeline.push_async_callback(rendering.close)
    await pipeline.enter_async_context(stages.running_stages(
        hub.settings, hub.engine, hub.outages, writer=hub.writer, runner=hub.stages,
        prepare=rendering.call))
    stages.add_assembly(hub.stages, hub.engine, hub.settings, hub.ingestor)


async def _start_background(
    hub: Hub, pipeline: AsyncExitStack, workers: bool, answering: asyncio.Event | None
) -> None:
    if answering is not None:
        await answering.wait()
        try:
            await _add_stages(hub, pipeline)
            # In a thread, though it holds the interpreter while it loads: requests
            # wait for it once, now, rather than the first compression pass later.
            await asyncio.to_thread(encoding)
        except Exception as exc:
            # Nothing awaits this task until the hub stops: said now, and at /readyz.
            # Traces are still taken (their ingest processes start with the first).
            log.exception("the background stages could not be built; they do not run")
            hub.outages.stages.failed(exc, "building them")
            return
        gc.freeze()  # what the stages imported and built, as running_hub does
    # Last: the fork server importing the hub takes a CPU for a second, which the
    # server's first answers (a restarted hub's clients poll it) would otherwise share.
    hub.ingestor.processes.start()
    if workers:
        hub.stages.start()
        log.info("Compression pipeline ready")


# One import at a time: two threads importing modules that import each other can each
# find the other's module half made.
_importing = threading.Lock()
R = TypeVar("R")


async def importing(work: Callable[[], R]) -> R:
    """work() in a thread, the event loop answering meanwhile, for what a server that
    already answers imports and builds (the stages, the API's other routes)."""

    def alone() -> R:
        with _importing:
            return work()

    return await asyncio.to_thread(alone)
