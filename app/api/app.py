"""create_app(config): the FastAPI application; its lifespan owns the hub."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.middleware.cors import CORSMiddleware

from app.api import atropos, batches, gateway, ops, runs, traces, ui
from app.api.errors import install_error_handlers
from app.api.http_metrics import RequestMetrics
from app.api.openapi import install_openapi
from app.evaluation.environment import Environment
from app.hub import Settings, running_hub


def create_app(
    settings: Settings,
    *,
    environment: Environment | None = None,
    engine: AsyncEngine | None = None,
    workers: bool = True,
    answering: asyncio.Event | None = None,
) -> FastAPI:
    """The API. Config errors (rules, filters) raise ConfigError here, before serving;
    `engine` may be opened (and migrated) by the caller, else the lifespan opens it;
    `answering`: see `running_hub`."""
    config = settings.config
    environment = environment or Environment.from_config(config.environment)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[dict[str, object]]:
        async with running_hub(
            settings, environment, engine=engine, workers=workers, answering=answering
        ) as hub:
            yield {"hub": hub}

    docs = config.auth.docs_enabled
    app = FastAPI(
        title="atropos-hub",
        summary="A durable trajectory hub for agent reinforcement learning",
        version="0.1.0",
        lifespan=lifespan,
        openapi_url="/openapi.json" if docs else None,
        # Served from the package (ui.install_docs): FastAPI's own pages load a CDN.
        docs_url=None,
        redoc_url=None,
    )
    install_error_handlers(app, page=ui.error_page)
    app.router.routes.append(traces.ingest_route(config.trace_server.endpoint))
    app.router.routes.extend(atropos.submission_routes(config.atropos.require_key))
    app.router.routes.extend(gateway.routes())
    app.include_router(atropos.router(config.atropos.require_key))
    app.include_router(traces.router(config.trace_server.endpoint))
    app.include_router(batches.router)
    app.include_router(ops.router)
    app.include_router(runs.router)
    app.include_router(gateway.router)
    ui.install(app)
    if docs:
        ui.install_docs(app)
    install_openapi(app, config.auth)  # after every router: it refuses an unguarded /v1 route
    if config.auth.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.auth.cors_origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "Content-Encoding"],
            expose_headers=["Retry-After"],
        )
    app.add_middleware(RequestMetrics)  # added last: the outermost, it times the others too
    return app
