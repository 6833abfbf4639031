"""The objects one hub process lives by, built from the config files: the engine,
the ingest path (inserter, ingestor) and the background stages. `atropos serve` owns
all of them through the API's lifespan; `atropos worker` only the stages."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import httpx
from sqlalchemy.ext.asyncio import AsyncEngine

from app.access.guard import Access
from app.atropos import Atropos
from app.atropos.hub_env import HubEnv
from app.atropos.tables import AtroposDb
from app.compression import ModelSummarizer
from app.config import AtroposTargetConfig, CompressionFile, HubConfig, TinkerFile
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
from app.metrics import summarizing
from app.outage import Outages
from app.runs import RunSupervisor
from app.stages.assembly import AssemblyStage
from app.stages.compression import CompressionStage, model_outage
from app.stages.delivery import DeliveryStage, training_outage
from app.stages.distribution import DistributionStage
from app.stages.env_groups import EnvGroupStage
from app.stages.grouping import GroupingStage
from app.stages.leases import Lease
from app.stages.retention import RetentionStage
from app.stages.rollouts import RolloutStage
from app.stages.runner import StageRunner
from app.targets import build_target

if TYPE_CHECKING:
    from app.gateway.service import Gateway

log = logging.getLogger("atropos")


@dataclass(frozen=True)
class Settings:
    """The three config files, loaded and checked once."""

    config: HubConfig
    compression: CompressionFile
    tinker: TinkerFile


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

# How soon the stages see traces committed by another process.
ARRIVALS_SECONDS = 1.0


def ingest_wakes(runner: StageRunner) -> Callable[[], None]:
    """The wake-up of an ingest commit: the stages a trace enters before (compression,
    or distribution past it: EntryStage in app/ingest/ingestor.py)."""
    return runner.waking(CompressionStage.name, DistributionStage.name)


@asynccontextmanager
async def running_stages(
    settings: Settings, engine: AsyncEngine, outages: Outages | None = None,
    writer: OneHop | None = None,
) -> AsyncIterator[StageRunner]:
    """The background stages in pipeline order, with the HTTP client they share. Each
    stage wakes the runner when it moves traces on, so the next stage starts at once.
    `writer`: the hub's one write connection (without it, the stages' own)."""
    config = settings.config
    outages = outages or hub_outages(engine, settings)
    runner = StageRunner(config.trace_server.flush_interval_seconds, outages.database,
                         config.workers.lease_seconds)
    lease = Lease(config.workers.lease_seconds)
    async with httpx.AsyncClient() as http:
        policy = settings.compression.compression
        # Traces another process commits (`atropos import` into the database, another
        # replica's ingest) wake no stage here: the first stage looks for them every
        # ARRIVALS_SECONDS, so that they move on within it.
        runner.add(
            CompressionStage(
                engine,
                policy,
                max_trace_tokens=config.trace_server.max_trace_tokens,
                lease=lease,
                summarizer=ModelSummarizer(http, settings.tinker.tinker),
                # Its own wake-up too: a retry's, when the backoff has passed.
                on_advance=runner.waking(CompressionStage.name, DistributionStage.name),
                model=outages.model,
            ),
            every=ARRIVALS_SECONDS,
        )
        hub_env = None
        if isinstance(config.distributor, AtroposTargetConfig):
            hub_env = HubEnv(AtroposDb(engine, writer), config.distributor, config.atropos,
                             outages.database)
            grouping = GroupingStage(hub_env, poll_seconds=min(
                ARRIVALS_SECONDS, config.distributor.group_timeout_seconds / 4))
            runner.add(grouping, every=grouping.poll_seconds)
        runner.add(
            DistributionStage(engine, config.distributor,
                              on_advance=runner.waking(DeliveryStage.name)),
            DeliveryStage(
                engine,
                build_target(config.distributor, settings.tinker.tinker, http, hub_env),
                config.distributor,
                lease=lease,
                on_advance=runner.wake,
                training=outages.training,
            ),
        )
        if config.retention is not None:
            runner.add(RetentionStage(engine, config.retention))
        if hub_env is not None:
            hub_env.start()
        try:
            yield runner
        finally:
            await runner.stop()
            if hub_env is not None:
                await hub_env.close()


def add_assembly(stages: StageRunner, engine: AsyncEngine, settings: Settings,
                 ingestor: Ingestor) -> None:
    """The stages that make trajectories and prepare them in `ingestor`'s processes:
    OTLP assembly, the gateway's rollouts, the groups envs send; their loops also wake
    every poll_seconds, since their traces come due with time rather than with a
    commit."""
    config = settings.config
    stage = AssemblyStage(engine, config.otlp, ingestor.prepare, on_advance=stages.wake)
    stages.add(stage, every=stage.poll_seconds)
    groups = EnvGroupStage(engine, ingestor, settings.tinker.tinker.tokenizer,
                           on_advance=stages.wake)
    stages.add(groups, every=groups.poll_seconds)
    if config.gateway.enabled:
        rollouts = RolloutStage(engine, config.gateway, ingestor.prepare, on_advance=stages.wake)
        stages.add(rollouts, every=rollouts.poll_seconds)


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
    answers HTTP and the tokenizer is loaded; the ingest processes and the stages start
    only then, so that a restarted hub answers within a second (atroposlib's envs give
    up after three tries in 1.5-3 s). A trace that arrives earlier waits for them.
    `clock`: monotonic seconds for the rate limits (a test's own, to move it)."""
    engine = engine or await open_database(settings.config)
    writer = OneHop(engine)
    outages = hub_outages(engine, settings)
    # Started by _start_background.
    processes = ingest_processes(settings.config, environment, outages.ingest,
                                 start_wait=settings.config.limits.max_write_wait_seconds,
                                 entry=entry_stage(settings))
    try:
        config = settings.config
        async with (
            summarizing(config.trace_server.log_summary_seconds),
            running_stages(settings, engine, outages, writer) as stages,
            running_ingest(
                engine, config, environment, admitted=True, on_commit=ingest_wakes(stages),
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
            add_assembly(stages, engine, settings, ingest.ingestor)
            atropos.start()
            spans.start()
            background = asyncio.create_task(
                _start_background(hub, workers, answering), name="hub-background"
            )
            try:
                if config.runs.enabled:
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


async def _start_background(hub: Hub, workers: bool, answering: asyncio.Event | None) -> None:
    if answering is not None:
        await answering.wait()
    hub.ingestor.processes.start()
    if workers:
        hub.stages.start()
        log.info("Compression pipeline ready")
