"""create_app(config): the FastAPI application; its lifespan owns the hub."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine

from app.api import batches, ops, runs, traces
from app.api.errors import install_error_handlers
from app.environment import Environment
from app.hub import Settings, running_hub


def create_app(
    settings: Settings,
    *,
    environment: Environment | None = None,
    engine: AsyncEngine | None = None,
    workers: bool = True,
) -> FastAPI:
    """The API. Config errors (rules, filters) raise ConfigError here, before serving;
    `engine` may be opened (and migrated) by the caller, else the lifespan opens it."""
    config = settings.config
    environment = environment or Environment.from_config(config.environment)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[dict[str, object]]:
        async with running_hub(settings, environment, engine=engine, workers=workers) as hub:
            yield {"hub": hub}

    app = FastAPI(
        title="atropos-hub",
        summary="A durable trajectory hub for agent reinforcement learning",
        version="0.1.0",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    app.include_router(traces.router(config.trace_server.endpoint))
    app.include_router(batches.router)
    app.include_router(ops.router)
    app.include_router(runs.router)
    return app
