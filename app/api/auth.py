"""The scope guard on /v1 routes.

A route opts in with one dependency, on the route or on its whole router:

    @api.get("/v1/things", dependencies=[requires(Scope.READ)])
    api = APIRouter(prefix="/v1/runs", dependencies=[requires(Scope.ADMIN)])

The guard rests on FastAPI's HTTPBearer, so each guarded operation carries its
`security` requirement (with the scope) in the OpenAPI document; `install_openapi`
adds the 401/403/429 answers to those operations and, from the same document,
`create_app` refuses to build an app with a /v1 operation that has no guard (an
endpoint added later cannot be open by mistake). /healthz, /readyz, /metrics and the
docs pages live outside /v1, open; so does the Atropos API (its clients send no key)
unless atropos.require_key is on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import cache
from typing import Annotated, Any

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.access.guard import Principal
from app.access.keys import Scope
from app.api.deps import HubDep
from app.api.openapi import BEARER_SCHEME
from app.hub import Hub

# auto_error off: a missing or malformed header is ours to answer, in the hub's shape.
_BEARER = HTTPBearer(
    scheme_name=BEARER_SCHEME,
    description="An API key from `atropos keys create`, when auth.enabled is true",
    auto_error=False,
)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]
Guard = Callable[..., Awaitable[Principal]]


@cache  # one guard per set of scopes: FastAPI shares what a dependency resolves to
def _guard(scopes: tuple[Scope, ...]) -> Guard:
    async def guard(request: Request, hub: HubDep, credentials: Credentials) -> Principal:
        return await _authorize(request, hub, credentials, scopes)

    guard.__name__ = "requires_" + "_or_".join(scopes)
    return guard


async def authorize(request: Request, hub: Hub, scopes: tuple[Scope, ...]) -> Principal:
    """What the guard of `requires(*scopes)` does, called without FastAPI's dependency
    solving (app/api/direct.py)."""
    # Auth off and no rate limit: the header is not even read.
    credentials = None if hub.access.admits_all else await _BEARER(request)
    return await _authorize(request, hub, credentials, scopes)


async def _authorize(
    request: Request,
    hub: Hub,
    credentials: HTTPAuthorizationCredentials | None,
    scopes: tuple[Scope, ...],
) -> Principal:
    client = request.client.host if request.client else "unknown"
    presented = credentials.credentials if credentials else None
    return await hub.access.authorize(presented, client, scopes)


def requires(*scopes: Scope) -> Any:
    """The dependency that admits a request with a key holding one of `scopes` (or
    admin)."""
    return Security(_guard(scopes), scopes=[scope.value for scope in scopes])


# A route that needs to know who calls (a review records its reviewer's key name).
ReviewerDep = Annotated[Principal, requires(Scope.REVIEW)]
