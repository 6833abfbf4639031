"""create_app(config): the FastAPI application; its lifespan owns the hub."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.middleware.cors import CORSMiddleware

from app.api import atropos, batches, gateway, ops, runs, traces, ui
from app.api.errors import install_error_handlers
from app.api.http_metrics import RequestMetrics
from app.api.middleware import BodiesInFlight, HostCheck, PageHeaders
from app.api.openapi import install_openapi
from app.config import HubConfig
from app.errors import ConfigError
from app.evaluation.environment import Environment
from app.hub import Settings, running_hub
from app.ingest.body import BodyBudget

log = logging.getLogger("atropos")


def create_app(
    settings: Settings,
    *,
    environment: Environment | None = None,
    engine: AsyncEngine | None = None,
    workers: bool = True,
    answering: asyncio.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> FastAPI:
    """The API. Config errors (rules, filters) raise ConfigError here, before serving;
    `engine` may be opened (and migrated) by the caller, else the lifespan opens it;
    `answering`, `clock`: see `running_hub`."""
    config = settings.config
    _check_runs_access(config)
    environment = environment or Environment.from_config(config.environment)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[dict[str, object]]:
        async with running_hub(
            settings, environment, engine=engine, workers=workers, answering=answering,
            clock=clock,
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
    atropos_keys = config.atropos.keys_required(config.auth)
    app.router.routes.extend(atropos.submission_routes(atropos_keys))
    app.router.routes.extend(gateway.routes())
    app.include_router(atropos.router(atropos_keys))
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
    app.add_middleware(PageHeaders)
    limits = config.limits
    app.add_middleware(BodiesInFlight, budget=BodyBudget(limits.max_body_bytes_in_flight,
                                                         limits.retry_after_seconds))
    ts = config.trace_server
    app.add_middleware(HostCheck, bind_host=ts.host, allowed=ts.allowed_hosts)
    app.add_middleware(RequestMetrics)  # added last: the outermost, it times the others too
    return app


def _check_runs_access(config: HubConfig) -> None:
    """Training runs start processes on this machine: without auth anyone who reaches
    the port could, so that takes saying so (runs.allow_without_auth), and is said at
    start-up."""
    if not config.runs.enabled or config.auth.enabled:
        return
    if not config.runs.allow_without_auth:
        raise ConfigError(
            "config.json: runs.enabled: with auth.enabled false anyone who reaches this "
            "port could start processes on this machine; turn auth on (auth.enabled: "
            "true, then `atropos keys create --scope admin --name admin`), or set "
            "runs.allow_without_auth: true to accept that"
        )
    log.warning(
        "runs.enabled with auth off (runs.allow_without_auth): anyone who reaches port "
        "%d can start processes on this machine as this user (docs/access.md)",
        config.trace_server.port,
    )
