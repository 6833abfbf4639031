"""/v1/traces: ingest, list, read one."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request

from app.access.keys import Scope
from app.api.auth import requires
from app.api.deps import ConnDep, HubDep
from app.api.openapi import errors
from app.api.responses import JSONResponse
from app.api.schemas import IngestResult, IngestResults, TracePage, TraceRecord
from app.db.trace_queries import TraceFilter, View, get_trace, list_traces
from app.domain import Stage, Status
from app.errors import HubError
from app.ingest.body import parse_items, read_body
from app.ingest.inserter import Stored

INGEST_BODY_DOC: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": (
            "One trace (native, openai, sharegpt/Hermes or atif; detected, or named "
            'with "format"), {"traces": [...]}, a JSON array, or NDJSON. May be gzip.'
        ),
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "application/x-ndjson": {"schema": {"type": "string"}},
        },
    },
}
# The hot path (thousands of traces a second) renders its answer with orjson itself; the
# models are declared for the document only (tests/test_openapi.py checks the bodies).
INGEST_ANSWERS: dict[int | str, dict[str, Any]] = {
    202: {"model": IngestResult, "description": "One trace, stored"},
    207: {"model": IngestResults, "description": "Batch or NDJSON: one result per item, in order"},
}


def router(endpoint: str) -> APIRouter:
    api = APIRouter(tags=["traces"])

    @api.post(
        endpoint,
        status_code=202,
        openapi_extra=INGEST_BODY_DOC,
        dependencies=[requires(Scope.INGEST)],
        responses={**INGEST_ANSWERS, **errors(400, 409, 413, 415, 422, 503)},
    )
    async def ingest(request: Request, hub: HubDep) -> JSONResponse:
        limits = hub.config.limits
        body = await read_body(request, limits.max_body_bytes)
        parsed = parse_items(
            body, request.headers.get("content-type", ""), limits.max_traces_per_request
        )
        if not parsed.batch:
            stored = await hub.ingestor.ingest(parsed.items[0])
            return JSONResponse(stored.to_json(), status_code=202)
        results = await hub.ingestor.ingest_many(parsed.items, parsed.fmt)
        return JSONResponse(
            {"results": [_result(r) for r in results]}, status_code=207
        )

    @api.get(endpoint, dependencies=[requires(Scope.READ)], responses=errors(400))
    async def list_(
        conn: ConnDep,
        # Fixed sets: a value outside them is a 422 naming the valid ones, not [].
        stage: Stage | None = None,
        status: Status | None = None,
        env: str | None = None,
        model: str | None = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        min_env_reward: float | None = None,
        max_env_reward: float | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 50,
        cursor: str | None = None,
    ) -> TracePage:
        where = TraceFilter(
            stage, status, env, model, min_reward, max_reward, since, until,
            min_env_reward, max_env_reward,
        )
        records, next_cursor = await list_traces(conn, where, limit, cursor)
        return TracePage(traces=records, next_cursor=next_cursor)

    @api.get(
        # :path, so that a trace_id holding "/" (raw or as %2F) is read back too.
        endpoint + "/{trace_id:path}", dependencies=[requires(Scope.READ)],
        responses=errors(404),
    )
    async def get(trace_id: str, conn: ConnDep, view: View = "canonical") -> TraceRecord:
        return TraceRecord.model_validate(await get_trace(conn, trace_id, view))

    return api


def _result(result: Stored | HubError) -> dict[str, Any]:
    return result.to_json()
