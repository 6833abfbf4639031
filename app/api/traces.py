"""/v1/traces: ingest (the hub's formats, and OTLP/HTTP traces), list, read one, review
one; /v1/review-queue: the next to review."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from app.access.guard import Principal
from app.access.keys import Scope
from app.api import otlp
from app.api.auth import ReviewerDep, requires
from app.api.deps import ConnDep, HubDep
from app.api.direct import DirectRoute
from app.api.openapi import errors
from app.api.params import TraceQuery
from app.api.responses import JSONResponse
from app.api.schemas import (
    IngestResults,
    ReviewBody,
    ReviewClaim,
    ReviewSaved,
    TokenView,
    TracePage,
    TraceRecord,
)
from app.db.review_queries import ReviewInput, claim_next, save_review
from app.db.trace_queries import View, get_original, get_trace, list_traces
from app.gateway.tokens import token_view
from app.ingest.body import parse_items, read_body
from app.ingest.inserter import IngestResult
from app.ingest.otlp.receiver import otlp_body

INGEST_BODY_DOC: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": (
            "One trace (native, openai, sharegpt/Hermes or atif; detected, or named "
            'with "format"), {"traces": [...]}, a JSON array, or NDJSON; or OTLP traces '
            "(protobuf, or OTLP/JSON with resourceSpans: docs/otlp.md). May be gzip."
        ),
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "application/x-ndjson": {"schema": {"type": "string"}},
            **otlp.REQUEST_CONTENT,
        },
    },
}
# The hot path (thousands of traces a second) renders its answer with orjson itself,
# built as the TypedDicts the document declares (app/api/schemas.py).
INGEST_ANSWERS: dict[int | str, dict[str, Any]] = {
    202: {"model": IngestResult, "description": "One trace, stored"},
    207: {"model": IngestResults, "description": "Batch or NDJSON: one result per item, in order"},
}


def ingest_route(endpoint: str) -> DirectRoute:
    """POST `endpoint`: the hot path, answered without FastAPI's dependency solving
    (app/api/direct.py). Added to the app itself, first: matched before any other."""
    return DirectRoute(
        endpoint,
        ingest,
        scopes=(Scope.INGEST,),
        methods=["POST"],
        status_code=202,
        tags=["traces"],
        openapi_extra=INGEST_BODY_DOC,
        responses={**INGEST_ANSWERS, **otlp.ANSWER, **errors(400, 409, 413, 415, 422, 503)},
    )


async def ingest(request: Request, hub: HubDep) -> Response:
    limits = hub.config.limits
    body = await read_body(request, limits.max_body_bytes)
    content_type = request.headers.get("content-type", "")
    spans = otlp_body(body, content_type)
    if spans is not None:
        otlp.mark(request, spans.encoding)
        receipt = await hub.spans.receive(spans)
        if receipt is not None:
            return otlp.answer(receipt, spans.encoding)
        otlp.mark(request, None)  # JSON that is not OTLP after all: the hub's own
    parsed = parse_items(body, content_type, limits.max_traces_per_request)
    if not parsed.batch:
        stored = await hub.ingestor.ingest(parsed.items[0])
        return JSONResponse(stored.to_json(), status_code=202)
    results = await hub.ingestor.ingest_many(parsed.items, parsed.fmt)
    answer: IngestResults = {"results": [r.to_json() for r in results]}
    return JSONResponse(answer, status_code=207)


def router(endpoint: str) -> APIRouter:
    """GET `endpoint` (the list), `endpoint`/{trace_id} and its review."""
    api = APIRouter(tags=["traces"])

    @api.get(endpoint, dependencies=[requires(Scope.READ)], responses=errors(400))
    async def list_(conn: ConnDep, query: Annotated[TraceQuery, Query()]) -> TracePage:
        records, next_cursor = await list_traces(
            conn, query.filter(), query.limit, query.cursor, query.sort
        )
        return TracePage(traces=records, next_cursor=next_cursor)

    @api.get(
        # :path, so that a trace_id holding "/" (raw or as %2F) is read back too.
        endpoint + "/{trace_id:path}", dependencies=[requires(Scope.READ)],
        responses={200: {"model": TraceRecord | TokenView}, **errors(404, 422)},
    )
    async def get(
        trace_id: str, conn: ConnDep, response: Response, view: View = "canonical"
    ) -> Any:
        """One trace: its canonical, original or compressed view; or, for a trajectory
        made by the gateway, `tokens`: {tokens, masks, logprobs, exact} (docs/gateway.md)."""
        # A trace may hold what a person should not find in a shared cache or a
        # browser's history: nothing keeps a copy.
        response.headers["Cache-Control"] = "no-store"
        if view == "tokens":
            source_format, original = await get_original(conn, trace_id)
            return TokenView.model_validate(token_view(trace_id, source_format, original))
        return TraceRecord.model_validate(await get_trace(conn, trace_id, view))

    @api.post(endpoint + "/{trace_id}/review", responses=errors(404, 422))
    async def review(
        trace_id: str,
        body: ReviewBody,
        hub: HubDep,
        principal: ReviewerDep,
    ) -> ReviewSaved:
        """Label the trace good or bad, with a note, and optionally override its reward.
        A bad trace is never batched; an overridden reward is what the threshold and
        exports use. A later review replaces this one."""
        saved = await save_review(
            hub.engine, trace_id, ReviewInput(body.label, body.note, body.reward),
            reviewer_name(principal),
        )
        return ReviewSaved.model_validate(saved)

    @api.post("/v1/review-queue/next", responses=errors(400))
    async def next_to_review(
        query: Annotated[TraceQuery, Query()],
        hub: HubDep,
        principal: ReviewerDep,
        skip: str | None = None,
    ) -> ReviewClaim:
        """The oldest unreviewed trace matching the filters (those of GET /v1/traces),
        held for this reviewer for 15 minutes: no other reviewer gets it meanwhile. A
        reviewer holds one trace at a time; `skip` passes over the one held."""
        claim = await claim_next(hub.engine, query.filter(), holder_of(principal), skip=skip)
        if claim is None:
            return ReviewClaim(trace_id=None, expires_at=None)
        return ReviewClaim(trace_id=claim.trace_id, expires_at=claim.expires_at.isoformat())

    return api


def reviewer_name(principal: Principal) -> str:
    """Who a review is recorded as: the API key's name, or `anonymous` with auth off."""
    return principal.key.name if principal.key is not None else "anonymous"


def holder_of(principal: Principal) -> str:
    """Who holds a queue claim: the API key (by id), or with auth off the address."""
    if principal.key is not None:
        return f"key:{principal.key.key_id}"
    return f"address:{principal.client}"
