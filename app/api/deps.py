"""Typed dependencies: routes reach the hub's objects through these, never globals."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncConnection

from app.hub import Hub


async def get_hub(request: Request) -> Hub:
    # async: a plain def dependency would be run in a worker thread on every request.
    hub: Hub = request.state.hub
    return hub


HubDep = Annotated[Hub, Depends(get_hub)]


async def get_conn(hub: HubDep) -> AsyncIterator[AsyncConnection]:
    async with hub.engine.connect() as conn:
        yield conn


ConnDep = Annotated[AsyncConnection, Depends(get_conn)]
