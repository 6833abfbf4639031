"""create_app(config): the FastAPI application; its lifespan owns the hub.

Served by `atropos serve`, the app is built in two parts, so that a restarted hub
answers within a second: what the first requests need (ingest, the Atropos API,
health, stats, the trace lists) before the server listens, and the rest (the
dashboard, batches, runs, the gateway's routes, /docs and the OpenAPI document) in a
thread once it answers. A request for the rest that comes earlier waits for it
(`_WaitForRest`), so that no request sees a 404 the finished app would not give."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api import atropos, ops, traces, ui
from app.api.errors import install_error_handlers
from app.api.http_metrics import RequestMetrics
from app.api.middleware import BodiesInFlight, HostCheck, PageHeaders
from app.api.openapi import install_openapi
from app.config import HubConfig, Settings
from app.errors import ConfigError
from app.evaluation.environment import Environment
from app.hub import importing, running_hub
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
    `answering`, `clock`: see `running_hub`; with `answering`, the routes beyond the
    first requests' are added once it is set (the module's docstring)."""
    config = settings.config
    _check_runs_access(config)
    environment = environment or Environment.from_config(config.environment)
    rest: _Rest | None = None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[dict[str, object]]:
        async with running_hub(
            settings, environment, engine=engine, workers=workers, answering=answering,
            clock=clock,
        ) as hub:
            adding = None
            if rest is not None and answering is not None:
                adding = asyncio.create_task(rest.add(app, config, answering), name="api-rest")
            try:
                yield {"hub": hub}
            finally:
                if adding is not None:
                    adding.cancel()
                    await asyncio.gather(adding, return_exceptions=True)

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
    own = list(app.router.routes)  # FastAPI's: /openapi.json, part of the rest
    app.router.routes.append(traces.ingest_route(config.trace_server.endpoint))
    atropos_keys = config.atropos.keys_required(config.auth)
    app.router.routes.extend(atropos.submission_routes(atropos_keys))
    direct_at = len(app.router.routes)
    app.include_router(atropos.router(atropos_keys))
    app.include_router(traces.router(config.trace_server.endpoint))
    app.include_router(ops.router)
    if answering is None:
        _add_rest(app, config, _rest_routes(app, config), direct_at)
    else:
        rest = _Rest([route for route in app.router.routes if route not in own], direct_at)
        app.add_middleware(_WaitForRest, rest=rest)  # the innermost: added first
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


# The routes added once the server answers: (direct, others). The direct ones (the
# gateway's hot path, without FastAPI's dependency solving) go first, as the ingest
# route does.
_Routes = tuple[list[BaseRoute], list[BaseRoute]]


def _rest_routes(app: FastAPI, config: HubConfig) -> _Routes:
    """Built apart from `app` (in a thread, when served), then added by _add_rest."""
    from app.api import batches, gateway, runs

    rest = APIRouter(dependency_overrides_provider=app)
    rest.include_router(batches.router)
    rest.include_router(runs.router)
    rest.include_router(gateway.router)
    ui.install(rest)
    if config.auth.docs_enabled:
        ui.install_docs(rest, app.title)
    return list(gateway.routes()), rest.routes


def _add_rest(app: FastAPI, config: HubConfig, routes: _Routes, direct_at: int) -> None:
    direct, others = routes
    app.router.routes[direct_at:direct_at] = direct
    app.router.routes.extend(others)
    install_openapi(app, config.auth)  # after every router: it refuses an unguarded /v1 route


class _Rest:
    """The routes beyond the first requests', added once the server answers."""

    def __init__(self, first: list[BaseRoute], direct_at: int) -> None:
        self.first = first
        self.direct_at = direct_at
        self.added = asyncio.Event()

    def serves(self, scope: Scope) -> bool:
        """Whether the first routes answer this request (else it waits for the rest)."""
        return self.added.is_set() or any(
            route.matches(scope)[0] is Match.FULL for route in self.first)

    async def add(self, app: FastAPI, config: HubConfig, answering: asyncio.Event) -> None:
        await answering.wait()
        try:
            routes = await importing(lambda: _rest_routes(app, config))
            _add_rest(app, config, routes, self.direct_at)
            gc.freeze()  # what they made lives as long as the app (running_hub says why)
        except Exception:
            # A broken install: the requests for these routes get 404 rather than wait.
            log.exception("the API's routes beyond the Atropos API and ingest could not "
                          "be added")
        finally:
            self.added.set()


class _WaitForRest:
    def __init__(self, app: ASGIApp, rest: _Rest) -> None:
        self.app = app
        self.rest = rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.rest.serves(scope):
            await self.rest.added.wait()
        await self.app(scope, receive, send)


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
