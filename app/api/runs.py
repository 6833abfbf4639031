"""/v1/runs: start, watch and stop training runs (app/runs, docs/runs.md)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response

from app.access.keys import Scope
from app.api.auth import requires
from app.api.deps import HubDep
from app.api.openapi import errors
from app.api.schemas import Run, RunCreated, RunList
from app.errors import Forbidden
from app.runs import RunSpec, RunStatus
from app.runs.supervisor import RunSupervisor


async def get_runs(hub: HubDep) -> RunSupervisor:
    if hub.runs is None:
        # 403, not 404: the feature exists and the answer says how to turn it on.
        raise Forbidden(
            "training runs are off on this hub; set runs.enabled to true in config.json "
            "(the runs endpoints start processes on the hub's machine)",
            code="runs_disabled",
            field="runs.enabled",
        )
    return hub.runs


RunsDep = Annotated[RunSupervisor, Depends(get_runs)]


# Runs start processes on the hub's machine: every route, reads too, is admin's.
router = APIRouter(prefix="/v1/runs", tags=["runs"], dependencies=[requires(Scope.ADMIN)])

_LOCATION = {"description": "The run's address", "schema": {"type": "string"}}
CREATED: dict[int | str, dict[str, Any]] = {201: {"headers": {"Location": _LOCATION}}}
# The routes that answer a Run leave out what was not set (response_model_exclude_unset):
# a process's log_tail is in the body only when asked for, with GET ...?tail=N.


@router.post("", status_code=201, responses={**CREATED, **errors(400, 403, 422)})
async def start_run(
    spec: RunSpec, request: Request, response: Response, hub: HubDep, runs: RunsDep
) -> RunCreated:
    """Record the run and start its processes in the background: trainer first, then
    each environment once the one before is healthy."""
    record = await runs.create(spec, hub.config.runs.hub_url or _hub_url(request))
    response.headers["Location"] = f"/v1/runs/{record.run_id}"
    return RunCreated(run_id=record.run_id, status=record.status)


@router.get("", responses=errors(403), response_model_exclude_unset=True)
async def list_runs(
    runs: RunsDep,
    status: RunStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> RunList:
    return RunList(runs=await runs.list(status, limit))


@router.get("/{run_id}", responses=errors(403, 404), response_model_exclude_unset=True)
async def get_run(
    run_id: str, runs: RunsDep, tail: Annotated[int, Query(ge=0, le=10_000)] = 0
) -> Run:
    """The run, its processes, and with `tail=N` the last N lines of each log."""
    return Run.model_validate(await runs.describe(run_id, tail))


@router.delete(
    "/{run_id}", status_code=202, responses=errors(403, 404, 409), response_model_exclude_unset=True
)
async def stop_run(run_id: str, runs: RunsDep) -> Run:
    """Stop the run: environments first, then the trainer (SIGTERM, stop_timeout,
    SIGKILL). Answers at once with status `stopping`; GET shows when it is `stopped`."""
    record = await runs.stop(run_id)
    return Run.model_validate(record.to_json())


def _hub_url(request: Request) -> str:
    """The address the request came in on: an address of this machine on which the
    hub answers, so the run's processes reach it there too."""
    server = request.scope.get("server")
    if not server:
        return str(request.base_url).rstrip("/")
    host, port = server[0], server[1]
    if ":" in host:
        host = f"[{host}]"
    return f"{request.url.scheme}://{host}:{port}"
