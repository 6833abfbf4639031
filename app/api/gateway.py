"""The model endpoint (app/gateway, docs/gateway.md): OpenAI's paths, at the root of
/v1 and under /v1/rollouts/{rollout_id}/ (a base URL per rollout), and the rollout's
finish. The call paths are DirectRoutes: answered without FastAPI's dependency solving,
as the ingest path is, since every agent step passes through them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.access.keys import Scope
from app.api.auth import requires
from app.api.deps import HubDep
from app.api.direct import DirectRoute
from app.api.openapi import errors
from app.api.schemas import RolloutFinish, RolloutFinished
from app.errors import Forbidden
from app.gateway.calls import Kind
from app.hub import Hub
from app.ingest.body import read_body

if TYPE_CHECKING:
    from app.gateway.service import Gateway

_PER_ROLLOUT = "/v1/rollouts/{rollout_id}"
_CALLS: tuple[tuple[str, Kind, str], ...] = (
    ("/chat/completions", "chat", "A chat completion (plain or `stream: true`), captured"),
    ("/completions", "completion", "A text completion (plain or streamed), captured"),
    ("/responses", "responses", "OpenAI's Responses API, forwarded and captured"),
)
_ANSWERS: dict[int | str, dict[str, Any]] = {
    200: {"description": "The upstream's answer as it gave it (JSON, or an SSE stream with "
                         "`stream: true`); an upstream error passes through with its status "
                         "and body",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "string"}}}},
    **errors(400, 403, 422, 502, 503, 504),
}
_REQUEST: dict[str, Any] = {"requestBody": {
    "required": True,
    "description": "The OpenAI API's request, as the agent's SDK sends it",
    "content": {"application/json": {"schema": {"type": "object"}}},
}}
_MODELS: dict[int | str, dict[str, Any]] = {
    200: {"description": "The upstream's models, and the routes' names",
          "content": {"application/json": {"schema": {"type": "object"}}}},
    **errors(403, 502),
}


def _gateway(hub: Hub) -> Gateway:
    if hub.gateway is None:
        raise Forbidden("the gateway is off on this hub; set gateway.enabled to true in "
                        "config.json", code="gateway_disabled", field="gateway.enabled")
    return hub.gateway


def _call(kind: Kind) -> Any:
    async def call(request: Request, hub: HubDep) -> Response:
        gateway = _gateway(hub)
        body = await read_body(request, hub.config.limits.max_body_bytes)
        return await gateway.call(kind, body, request.headers,
                                  request.path_params.get("rollout_id"))

    return call


async def _models(request: Request, hub: HubDep) -> Response:
    return await _gateway(hub).models()


def routes() -> list[DirectRoute]:
    out = []
    for prefix in ("/v1", _PER_ROLLOUT):
        for path, kind, summary in _CALLS:
            out.append(DirectRoute(prefix + path, _call(kind), scopes=(Scope.GATEWAY,),
                                   methods=["POST"], tags=["gateway"], summary=summary,
                                   responses=_ANSWERS, openapi_extra=_REQUEST))
        out.append(DirectRoute(prefix + "/models", _models, scopes=(Scope.GATEWAY,),
                               methods=["GET"], tags=["gateway"],
                               summary="The upstream's models, and the routes' names",
                               responses=_MODELS))
    return out


router = APIRouter(tags=["gateway"])


@router.post(_PER_ROLLOUT + "/finish", dependencies=[requires(Scope.GATEWAY)],
             responses=errors(403, 404, 422))
async def finish(rollout_id: str, body: RolloutFinish, hub: HubDep) -> RolloutFinished:
    """Close the rollout now: its trajectory (the trace `rollout_id`) is made at once,
    with the reward as its env_reward. A finish may come again later (a late reward):
    the trajectory is made again, unless it was batched already."""
    done = await _gateway(hub).finish(rollout_id, body.model_dump(exclude_none=True))
    hub.stages.wake()  # its trajectory is due now
    return RolloutFinished.model_validate(done)
