"""The objects one hub process lives by, built from the config files and owned by
the API's lifespan (or by `atropos worker`): engine, inserter, ingestor, stages."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import CompressionFile, HubConfig, TinkerFile
from app.db import migrate
from app.db.engine import create_engine, database_url, redacted
from app.environment import Environment
from app.ingest import Ingestor
from app.inserter import TraceInserter
from app.worker import StageRunner

log = logging.getLogger("atropos")


@dataclass
class Hub:
    config: HubConfig
    compression: CompressionFile
    tinker: TinkerFile
    engine: AsyncEngine
    inserter: TraceInserter
    ingestor: Ingestor
    stages: StageRunner


async def open_database(config: HubConfig) -> AsyncEngine:
    """The engine, with the schema brought to the current revision first."""
    engine = create_engine(config.trace_server)
    log.info("database %s", redacted(database_url(config.trace_server)))
    await migrate.upgrade(engine)
    return engine


@asynccontextmanager
async def running_hub(
    config: HubConfig,
    compression: CompressionFile,
    tinker: TinkerFile,
    environment: Environment,
    *,
    engine: AsyncEngine | None = None,
    workers: bool = True,
) -> AsyncIterator[Hub]:
    engine = engine or await open_database(config)
    stages = StageRunner([], config.trace_server.flush_interval_seconds)
    inserter = TraceInserter(engine, on_commit=stages.wake)
    hub = Hub(
        config=config,
        compression=compression,
        tinker=tinker,
        engine=engine,
        inserter=inserter,
        ingestor=Ingestor(inserter, environment),
        stages=stages,
    )
    inserter.start()
    if workers:
        stages.start()
    try:
        yield hub
    finally:
        await inserter.stop()
        hub.ingestor.close()
        await stages.stop()
        await engine.dispose()
