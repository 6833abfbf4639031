"""The Atropos trajectory API at atroposlib 0.4.0's paths, with its request models,
response keys and defaults; plus GET /batch?ack=1 and POST /batch/ack. Each route
parses, calls one `Atropos` method, and answers. docs/atropos.md has the details.

Keys: /reset_data needs an admin key whenever auth.enabled is on. With
atropos.require_key the others need one too: an environment's paths `ingest`, a
trainer's `train`, and the run's read-only figures (which both sides read) any key.

Most routes return their models, as the /v1 routes do. POST /scored_data(_list) render
their receipts, built as the TypedDicts the document declares; /register, /batch,
/latest_example and / answer the bytes atroposlib's clients expect (a 128-bit uuid,
batches joined from stored JSON), rendered here, with `response_model=` declaring
them for the document only (app/api/schemas.py)."""

from __future__ import annotations

import json
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.responses import PlainTextResponse, RedirectResponse, Response

from app.access.keys import Scope
from app.api.auth import requires
from app.api.deps import HubDep
from app.api.direct import DirectRoute
from app.api.gzipped import GzipRoute, wants_gzip
from app.api.openapi import errors
from app.api.responses import JSONResponse
from app.api.schemas import (
    AtroposEnvStatus,
    AtroposInfo,
    AtroposRoot,
    AtroposStatus,
    BatchAcked,
    EnvDisconnected,
    EnvRegistered,
    NoExample,
    TrainerBatch,
    TrainerNotRegistered,
    TrainerRegistered,
    WaitForTrainer,
    WandbInfo,
)
from app.atropos.models import (
    INT32_MAX,
    INT32_MIN,
    BatchAck,
    EnvIdentifier,
    GroupReceived,
    GroupsReceived,
    RegisterEnv,
    Registration,
    ScoredData,
)
from app.atropos.segments import Segment, gzip_join, plain_join
from app.errors import BadRequest, Invalid, UnsupportedMediaType
from app.ingest.body import read_body

_BODY_ERRORS = errors(400, 413, 415, 422)
_QUEUE_ERRORS = errors(400, 413, 415, 422, 503)
_ROOT_REDIRECT: dict[int | str, dict[str, Any]] = {
    307: {"description": "To the dashboard (/ui), for a request that accepts text/html"}
}
_ACK_ERRORS = errors(400, 404, 413, 415, 422, 503)
M = TypeVar("M", bound=BaseModel)
_ENV_REGISTERED: TypeAdapter[EnvRegistered | WaitForTrainer] = TypeAdapter(
    EnvRegistered | WaitForTrainer)


def submission_routes(require_key: bool = False) -> list[DirectRoute]:
    """POST /scored_data and /scored_data_list, the environments' hot path (thousands
    of groups a second), answered without FastAPI's dependency solving
    (app/api/direct.py). Added to the app itself, first, as the trace ingest route is.
    Their answers are a few bytes: never gzipped."""

    async def scored_data(request: Request, hub: HubDep) -> Response:
        # Validated (as ScoredData) where it is deflated: in an ingest process.
        return JSONResponse(await hub.atropos.scored_data(await _body(request, hub)))

    async def scored_data_list(request: Request, hub: HubDep) -> Response:
        return JSONResponse(await hub.atropos.scored_data_list(await _body(request, hub)))

    scopes = (Scope.INGEST,) if require_key else None
    return [
        DirectRoute("/scored_data", scored_data, scopes=scopes, methods=["POST"],
                    tags=["atropos"], response_model=GroupReceived,
                    openapi_extra=_body_doc(ScoredData), responses=_QUEUE_ERRORS),
        DirectRoute("/scored_data_list", scored_data_list, scopes=scopes, methods=["POST"],
                    tags=["atropos"], response_model=GroupsReceived,
                    openapi_extra=_body_doc(ScoredData, many=True), responses=_QUEUE_ERRORS),
    ]


def router(require_key: bool = False) -> APIRouter:
    api = APIRouter(tags=["atropos"], route_class=GzipRoute)

    def key(*scopes: Scope) -> list[Any]:
        return [requires(*scopes)] if require_key else []

    env, trainer = key(Scope.INGEST), key(Scope.TRAIN)
    anyone = key(Scope.INGEST, Scope.TRAIN, Scope.READ)

    @api.get("/", response_model=AtroposRoot, responses=_ROOT_REDIRECT)
    async def root(request: Request) -> Response:
        """Atropos clients get atroposlib's answer; a browser (one that asks for HTML)
        is sent to the dashboard."""
        if "text/html" in request.headers.get("accept", ""):
            return RedirectResponse("/ui", status_code=307)
        return JSONResponse({"message": "AtroposLib API"})

    @api.post(
        "/register",
        dependencies=trainer,
        response_model=TrainerRegistered,
        openapi_extra=_body_doc(Registration),
        responses=_BODY_ERRORS,
    )
    async def register(request: Request, hub: HubDep) -> Response:
        body = _parse(Registration, await _body(request, hub))
        # The uuid is a 128-bit int, beyond orjson; the stdlib writes any int.
        return _raw_json(json.dumps(await hub.atropos.register(body)).encode())

    @api.post(
        "/register-env",
        dependencies=env,
        openapi_extra=_body_doc(RegisterEnv),
        responses=_BODY_ERRORS,
    )
    async def register_env(request: Request, hub: HubDep) -> EnvRegistered | WaitForTrainer:
        body = _parse(RegisterEnv, await _body(request, hub))
        return _ENV_REGISTERED.validate_python(await hub.atropos.register_env(body))

    @api.post(
        "/disconnect-env",
        dependencies=env,
        openapi_extra=_body_doc(EnvIdentifier),
        responses=_BODY_ERRORS,
        response_model_exclude_unset=True,  # atroposlib leaves out `error` on success
    )
    async def disconnect_env(request: Request, hub: HubDep) -> EnvDisconnected:
        body = _parse(EnvIdentifier, await _body(request, hub))
        return EnvDisconnected.model_validate(await hub.atropos.disconnect_env(body.env_id))

    @api.get(
        "/batch",
        dependencies=trainer,
        response_model=TrainerBatch | TrainerNotRegistered,
        responses=errors(422, 503),
        description=(
            "Takes the next batch: a GET that changes state, as atroposlib's trainers "
            "call it. Any web page can make a browser send a GET (an <img>), so with "
            "the Atropos API open (atropos.require_key off) a page its visitor opens "
            "can consume batches; with auth.enabled it needs a `train` key by default."
        ),
    )
    async def batch(
        request: Request,
        hub: HubDep,
        ack: Annotated[
            bool, Query(description="lease the batch; confirm it with POST /batch/ack")
        ] = False,
    ) -> Response:
        return _segments_json(request, await hub.atropos.next_batch(ack=ack))

    @api.post(
        "/batch/ack",
        dependencies=trainer,
        response_model=BatchAcked,
        openapi_extra=_body_doc(BatchAck),
        responses=_ACK_ERRORS,
    )
    async def batch_ack(request: Request, hub: HubDep) -> BatchAcked:
        body = _parse(BatchAck, await _body(request, hub))
        return BatchAcked.model_validate(await hub.atropos.acknowledge(body.batch_id))

    @api.get("/latest_example", dependencies=trainer, response_model=ScoredData | NoExample)
    async def latest_example(request: Request, hub: HubDep) -> Response:
        return _segments_json(request, await hub.atropos.latest_example())

    @api.get("/status", dependencies=anyone, response_model=AtroposStatus)
    async def status(hub: HubDep) -> AtroposStatus:
        return AtroposStatus.model_validate(await hub.atropos.status())

    @api.get(
        "/status-env",
        dependencies=env,
        openapi_extra=_body_doc(EnvIdentifier, required=False),
        responses=errors(400, 404, 413, 415, 422),
    )
    async def status_env(
        request: Request,
        hub: HubDep,
        env_id: Annotated[int | None, Query(ge=INT32_MIN, le=INT32_MAX)] = None,
    ) -> AtroposEnvStatus:
        # atroposlib's env client sends {"env_id": n} as the body of this GET;
        # ?env_id=n works too.
        raw = await _body(request, hub, optional=env_id is not None)
        if raw is not None:
            env_id = _parse(EnvIdentifier, raw).env_id
        assert env_id is not None
        return AtroposEnvStatus.model_validate(await hub.atropos.status_env(env_id))

    @api.get("/info", dependencies=anyone, response_model=AtroposInfo)
    async def info(hub: HubDep) -> AtroposInfo:
        return AtroposInfo.model_validate(await hub.atropos.info())

    @api.get("/wandb_info", dependencies=anyone, response_model=WandbInfo)
    async def wandb_info(hub: HubDep) -> WandbInfo:
        return WandbInfo.model_validate(await hub.atropos.wandb_info())

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
    and absent. A POST must say it is JSON: any web page can make a browser POST
    text/plain or a form to this port (no CORS preflight asks first), while
    atroposlib's clients always send application/json."""
    if request.method == "POST":
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise UnsupportedMediaType(
                f"Content-Type {media or '(none)'!r} is not accepted here; send the body "
                "as application/json", field="Content-Type")
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
        raise Invalid.from_pydantic(exc.errors(include_url=False)) from None


def _raw_json(body: bytes) -> Response:
    return Response(body, media_type="application/json")


def _segments_json(request: Request, segments: list[Segment]) -> Response:
    """Stored JSON as a client takes it: the segments spliced into one gzip answer
    when it accepts gzip (as GzipRoute would send a body of that size), else inflated."""
    if wants_gzip(request, sum(s.size for s in segments)):
        headers = {"content-encoding": "gzip", "vary": "Accept-Encoding"}
        return Response(gzip_join(segments), media_type="application/json", headers=headers)
    return _raw_json(plain_join(segments))


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
