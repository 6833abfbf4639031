"""The Atropos trajectory API at atroposlib 0.4.0's paths, with its request models,
response keys and defaults; plus GET /batch?ack=1 and POST /batch/ack. Each route
parses, calls one `Atropos` method, and answers. docs/atropos.md has the details."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.responses import PlainTextResponse, Response

from app.access.keys import Scope
from app.api.auth import requires
from app.api.deps import HubDep
from app.api.gzipped import GzipRoute
from app.api.openapi import errors
from app.api.responses import JSONResponse
from app.atropos.models import (
    INT32_MAX,
    INT32_MIN,
    BatchAck,
    EnvIdentifier,
    InvalidGroups,
    RegisterEnv,
    Registration,
    ScoredData,
    parse_group,
    parse_groups,
)
from app.errors import BadRequest, PayloadTooLarge
from app.ingest.body import json_array, read_body

_BODY_ERRORS = errors(400, 413, 415, 422)
_QUEUE_ERRORS = errors(400, 413, 415, 422, 503)
_ACK_ERRORS = errors(400, 404, 413, 415, 422, 503)
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
# Groups in a body of this size or more are validated in a thread, one at a time, so
# that the event loop serves other requests between them.
_THREAD_FROM = 256 * 1024


def router() -> APIRouter:
    api = APIRouter(tags=["atropos"], route_class=GzipRoute)

    @api.get("/")
    async def root() -> JSONResponse:
        return JSONResponse({"message": "AtroposLib API"})

    @api.post("/register", openapi_extra=_body_doc(Registration), responses=_BODY_ERRORS)
    async def register(request: Request, hub: HubDep) -> Response:
        body = _parse(Registration, await _body(request, hub))
        # The uuid is a 128-bit int, beyond orjson; the stdlib writes any int.
        return _raw_json(json.dumps(await hub.atropos.register(body)).encode())

    @api.post("/register-env", openapi_extra=_body_doc(RegisterEnv), responses=_BODY_ERRORS)
    async def register_env(request: Request, hub: HubDep) -> JSONResponse:
        body = _parse(RegisterEnv, await _body(request, hub))
        return JSONResponse(await hub.atropos.register_env(body))

    @api.post("/disconnect-env", openapi_extra=_body_doc(EnvIdentifier), responses=_BODY_ERRORS)
    async def disconnect_env(request: Request, hub: HubDep) -> JSONResponse:
        body = _parse(EnvIdentifier, await _body(request, hub))
        return JSONResponse(await hub.atropos.disconnect_env(body.env_id))

    @api.post("/scored_data", openapi_extra=_body_doc(ScoredData), responses=_QUEUE_ERRORS)
    async def scored_data(request: Request, hub: HubDep) -> JSONResponse:
        body = await _body(request, hub)
        group = await _validated(parse_group, body, large=len(body) >= _THREAD_FROM)
        return JSONResponse(await hub.atropos.scored_data(group))

    @api.post(
        "/scored_data_list",
        openapi_extra=_body_doc(ScoredData, many=True),
        responses=_QUEUE_ERRORS,
    )
    async def scored_data_list(request: Request, hub: HubDep) -> JSONResponse:
        body = await _body(request, hub)
        limit = hub.config.atropos.max_groups_per_request
        too_many = PayloadTooLarge(
            f"more than {limit} groups in one list; atropos.max_groups_per_request is "
            f"{limit}: send them in several requests",
            field="atropos.max_groups_per_request",
        )
        # Counted before any group is built.
        texts = json_array(body, limit, too_many)
        groups = await _validated(parse_groups, texts, large=len(body) >= _THREAD_FROM)
        return JSONResponse(await hub.atropos.scored_data_list(groups))

    @api.get("/batch", responses=errors(422, 503))
    async def batch(
        hub: HubDep,
        ack: Annotated[
            bool, Query(description="lease the batch; confirm it with POST /batch/ack")
        ] = False,
    ) -> Response:
        return _raw_json(await hub.atropos.next_batch(ack=ack))

    @api.post("/batch/ack", openapi_extra=_body_doc(BatchAck), responses=_ACK_ERRORS)
    async def batch_ack(request: Request, hub: HubDep) -> JSONResponse:
        body = _parse(BatchAck, await _body(request, hub))
        return JSONResponse(await hub.atropos.acknowledge(body.batch_id))

    @api.get("/latest_example")
    async def latest_example(hub: HubDep) -> Response:
        return _raw_json(await hub.atropos.latest_example())

    @api.get("/status")
    async def status(hub: HubDep) -> JSONResponse:
        return JSONResponse(await hub.atropos.status())

    @api.get(
        "/status-env",
        openapi_extra=_body_doc(EnvIdentifier, required=False),
        responses=errors(400, 404, 413, 415, 422),
    )
    async def status_env(
        request: Request,
        hub: HubDep,
        env_id: Annotated[int | None, Query(ge=INT32_MIN, le=INT32_MAX)] = None,
    ) -> JSONResponse:
        # atroposlib's env client sends {"env_id": n} as the body of this GET;
        # ?env_id=n works too.
        raw = await _body(request, hub, optional=env_id is not None)
        if raw is not None:
            env_id = _parse(EnvIdentifier, raw).env_id
        assert env_id is not None
        return JSONResponse(await hub.atropos.status_env(env_id))

    @api.get("/info")
    async def info(hub: HubDep) -> JSONResponse:
        return JSONResponse(await hub.atropos.info())

    @api.get("/wandb_info")
    async def wandb_info(hub: HubDep) -> JSONResponse:
        return JSONResponse(await hub.atropos.wandb_info())

    @api.get(
        "/reset_data",
        # The one Atropos path that destroys: an admin key when auth.enabled is on.
        dependencies=[requires(Scope.ADMIN)],
        response_class=PlainTextResponse,
    )
    async def reset_data(hub: HubDep) -> PlainTextResponse:
        await hub.atropos.reset()
        return PlainTextResponse("Reset successful")

    return api


async def _body(request: Request, hub: HubDep, *, optional: bool = False) -> Any:
    """The body, gunzipped and bounded by limits.max_body_bytes; None when optional
    and absent."""
    try:
        return await read_body(request, hub.config.limits.max_body_bytes)
    except BadRequest as exc:
        if optional and exc.code == "empty_body":
            return None
        raise


def _parse(model: type[M], raw: bytes) -> M:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        # Rendered by the one validation handler, like FastAPI's own body errors.
        raise RequestValidationError(exc.errors(include_url=False)) from None


async def _validated(parse: Callable[[Any], T], raw: Any, *, large: bool) -> T:
    """`parse(raw)`, in a thread when `large`; its InvalidGroups rendered like FastAPI's
    own body errors."""
    try:
        return await asyncio.to_thread(parse, raw) if large else parse(raw)
    except InvalidGroups as exc:
        raise RequestValidationError(exc.errors) from None


def _raw_json(body: bytes) -> Response:
    return Response(body, media_type="application/json")


def _body_doc(
    model: type[BaseModel], *, many: bool = False, required: bool = True
) -> dict[str, Any]:
    schema: dict[str, Any] = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs", None)
    if many:
        schema = {"type": "array", "items": schema}
    return {
        "requestBody": {
            "required": required,
            "description": "JSON; may be gzip (Content-Encoding: gzip)",
            "content": {"application/json": {"schema": schema}},
        }
    }
