"""Typed dependencies: routes reach the hub's objects through these, never globals."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncConnection

from app.errors import Forbidden
from app.hub import Hub
from app.runs import RunSupervisor


async def get_hub(request: Request) -> Hub:
    # async: a plain def dependency would be run in a worker thread on every request.
    hub: Hub = request.state.hub
    return hub


HubDep = Annotated[Hub, Depends(get_hub)]


async def get_conn(hub: HubDep) -> AsyncIterator[AsyncConnection]:
    async with hub.engine.connect() as conn:
        yield conn


ConnDep = Annotated[AsyncConnection, Depends(get_conn)]


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
