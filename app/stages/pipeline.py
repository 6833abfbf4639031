"""The background stages of one process, wired from the config files: compression,
the hub's own env's grouping, distribution, delivery, retention, and the stages that
assemble trajectories (OTLP spans, the gateway's rollouts, the groups envs send).
`atropos worker` runs them alone; `atropos serve` imports this module only once it
answers HTTP (app/hub.py): their modules (targets, training, compression) are not
needed for a first request."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from sqlalchemy.ext.asyncio import AsyncEngine

from app.atropos.hub_env import HubEnv
from app.atropos.tables import AtroposDb
from app.compression import ModelSummarizer
from app.config import AtroposTargetConfig, Settings
from app.db.dialect import OneHop
from app.ingest.ingestor import Ingestor
from app.outage import Outages
from app.stages import COMPRESSION, DELIVERY, DISTRIBUTION
from app.stages.assembly import AssemblyStage
from app.stages.compression import CompressionStage
from app.stages.delivery import DeliveryStage
from app.stages.distribution import DistributionStage
from app.stages.env_groups import EnvGroupStage
from app.stages.grouping import GroupingStage
from app.stages.leases import Lease
from app.stages.retention import RetentionStage
from app.stages.rollouts import RolloutStage
from app.stages.runner import StageRunner
from app.targets import build_target

# How soon the stages see traces committed by another process.
ARRIVALS_SECONDS = 1.0


@asynccontextmanager
async def running_stages(
    settings: Settings, engine: AsyncEngine, outages: Outages, *,
    writer: OneHop | None = None, runner: StageRunner | None = None,
    prepare: Callable[..., Awaitable[Any]] | None = None,
) -> AsyncIterator[StageRunner]:
    """The background stages in pipeline order, with the HTTP client they share. Each
    stage wakes the runner when it moves traces on, so the next stage starts at once.
    `writer`: the hub's one write connection (without it, the stages' own); `runner`:
    the hub's, which has existed since it started (without it, one of their own);
    `prepare`: where delivery renders batch files, `prepare(work, *args)` (a hub's
    ingest process of their own, `IngestProcesses.apart`; without it, a thread)."""
    config = settings.config
    runner = runner or StageRunner.of(config, outages.database)
    lease = Lease(config.workers.lease_seconds)
    own_writer = writer is None
    writer = writer or OneHop(engine)
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
                on_advance=runner.waking(COMPRESSION, DISTRIBUTION),
                model=outages.model,
                writer=writer,
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
                              on_advance=runner.waking(DELIVERY), writer=writer),
            DeliveryStage(
                engine,
                build_target(config.distributor, settings.tinker.tinker, http, hub_env),
                config.distributor,
                lease=lease,
                on_advance=runner.wake,
                training=outages.training,
                writer=writer,
                prepare=prepare,
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
            if own_writer:
                await writer.close()


def add_assembly(stages: StageRunner, engine: AsyncEngine, settings: Settings,
                 ingestor: Ingestor) -> None:
    """The stages that make trajectories and prepare them in `ingestor`'s processes:
    OTLP assembly, the gateway's rollouts, the groups envs send; their loops also wake
    every poll_seconds, since their traces come due with time rather than with a
    commit."""
    config = settings.config
    stage = AssemblyStage(engine, config.otlp, ingestor.prepare, on_advance=stages.take_on)
    stages.add(stage, every=stage.poll_seconds)
    groups = EnvGroupStage(engine, ingestor, settings.tinker.tinker.tokenizer,
                           on_advance=stages.wake)
    stages.add(groups, every=groups.poll_seconds)
    if config.gateway.enabled:
        rollouts = RolloutStage(engine, config.gateway, ingestor.prepare,
                                on_advance=stages.take_on)
        stages.add(rollouts, every=rollouts.poll_seconds)
