"""Routes answered without FastAPI's per-request machinery, for the hot paths (POST
/v1/traces, POST /scored_data: thousands of requests a second).

A `DirectRoute` is an APIRoute like any other for the OpenAPI document, the app's
exception handlers and the middleware around the router; but each request goes
straight to its endpoint, with the scope guard checked by the same code as the
`requires` dependency (app/api/auth.py), instead of through FastAPI's dependency
solving and exit stacks (most of the route's time on the serving process:
docs/ingest.md, "Where the time goes"). Its endpoint takes exactly the
request and the hub, and answers a Response.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app.access.keys import Scope as KeyScope
from app.api.auth import authorize, requires
from app.api.deps import get_hub
from app.hub import Hub

Endpoint = Callable[[Request, Hub], Awaitable[Response]]


class DirectRoute(APIRoute):
    def __init__(
        self, path: str, endpoint: Endpoint, *, scopes: tuple[KeyScope, ...] | None,
        **options: Any,
    ) -> None:
        """`scopes`: a key holding one of them is required (auth.enabled), and the rate
        limit applies; None: the route is open (the Atropos API without require_key)."""
        guard = [] if scopes is None else [requires(*scopes)]
        super().__init__(path, endpoint, dependencies=guard, **options)
        declared = {d.call for d in self.dependant.dependencies} - {get_hub}
        if self.dependant.query_params or self.dependant.body_params or len(declared) > 1:
            raise TypeError(f"{path}: a DirectRoute's endpoint takes the request and the hub only")
        self._endpoint = endpoint
        self._scopes = scopes
        self.app = self._answer

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        hub: Hub = scope["state"]["hub"]  # as get_hub reads it
        if self._scopes is not None:
            await authorize(request, hub, self._scopes)
        response = await self._endpoint(request, hub)
        await response(scope, receive, send)
