"""Health, readiness, stats and metrics: for curl, Docker and Prometheus."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from sqlalchemy.exc import SQLAlchemyError
from starlette.responses import PlainTextResponse, Response

from app import metrics as app_metrics
from app.access.keys import Scope
from app.api.auth import requires
from app.api.deps import ConnDep, HubDep
from app.api.responses import JSONResponse
from app.api.schemas import Health, NotReady, Ready, TraceStats
from app.db import migrate, trace_queries
from app.db.types import utcnow
from app.gateway import store as gateway_store
from app.ingest.otlp import store as otlp_store

router = APIRouter(tags=["ops"])


@router.get("/healthz")
async def healthz() -> Health:
    return Health(status="ok")


# A probe's answer, not a request's error: the 503 body says why, in its own shape.
NOT_READY: dict[int | str, dict[str, Any]] = {
    503: {
        "model": NotReady,
        "description": "The database is unreachable, not migrated, or not taking writes",
    }
}


@router.get("/readyz", response_model=Ready, responses=NOT_READY)
async def readyz(hub: HubDep) -> Ready | JSONResponse:
    """503 while traces cannot be taken (the database, its writes, the ingest
    processes); 200 otherwise, listing what else is failing (the summary model, the
    training service), which holds up no trace's answer."""
    failing = hub.outages.failing()
    try:
        revision = await migrate.current_revision(hub.engine)
    except (SQLAlchemyError, OSError) as exc:
        return _not_ready(f"database unreachable: {type(exc).__name__}", failing)
    head = migrate.head_revision()
    if revision != head:
        return _not_ready(f"schema at {revision}, expected {head}", failing)
    # Reads may work while writes do not (a full disk, a lock held elsewhere): a load
    # balancer should stop sending traces until they do again.
    writes = hub.write_problem()
    if writes is not None:
        return _not_ready(f"not taking writes: {writes}", failing)
    processes = failing.get(hub.outages.ingest.subject)
    if processes is not None:
        return _not_ready(f"the ingest processes are failing: {processes}", failing)
    return Ready(status="ready", schema_revision=head, failing=failing)


def _not_ready(reason: str, failing: dict[str, str]) -> JSONResponse:
    body = NotReady(status="unavailable", reason=reason, failing=failing)
    return JSONResponse(body.model_dump(), 503)


@router.get("/v1/stats", dependencies=[requires(Scope.READ)])
async def stats(conn: ConnDep, hub: HubDep) -> TraceStats:
    figures = await trace_queries.stats(conn, hub.config.distributor.min_reward_threshold)
    atropos = {"envs": await hub.atropos.env_stats(), **await hub.atropos.queue_figures(),
               "hub_env": await hub.atropos.hub_env_figures()}
    return TraceStats.model_validate(
        {**figures, "otlp": await otlp_store.counts(conn),
         "gateway": await gateway_store.counts(conn), "atropos": atropos}
    )


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(conn: ConnDep, hub: HubDep) -> Response:
    """Prometheus' text format: the counters (app/metrics.py) and, read now, what the
    database holds."""
    counts = await trace_queries.pipeline_counts(conn)
    families = app_metrics.database_families(
        counts["traces"], counts["trace_tokens"], counts["batches"],
        await hub.atropos.queue_figures(), utcnow(),
    )
    return Response(app_metrics.exposition(families), media_type=app_metrics.CONTENT_TYPE)
