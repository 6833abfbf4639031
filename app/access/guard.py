"""Who may call a /v1 endpoint: the API key (when auth is on), its scope, and its rate.

`authorize` answers in this order: no or bad key -> Unauthorized (401); over the
rate -> RateLimited (429); key without the scope -> Forbidden (403).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from app.access.keys import ApiKey, KeyRing, Scope
from app.access.ratelimit import RateLimiter
from app.access.sessions import Sessions
from app.config import AuthConfig
from app.errors import Forbidden, RateLimited, Unauthorized

log = logging.getLogger("atropos.auth")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is from: a key, or (auth off) just an address."""

    key: ApiKey | None
    client: str


class Access:
    def __init__(self, config: AuthConfig, engine: AsyncEngine,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: monotonic seconds, which the rate limit refills by."""
        self.config = config
        self._keys = KeyRing(engine, config.key_cache_seconds)
        self.sessions = Sessions(engine, self._keys, timedelta(hours=config.session_hours))
        rate = config.rate_limit_per_second
        self._limiter = RateLimiter(rate, config.rate_limit_burst, clock) if rate else None
        # Auth off and no rate limit: every request is admitted, whatever it presents.
        self.admits_all = not config.enabled and self._limiter is None

    async def authorize(
        self, presented: str | None, client: str, scopes: tuple[Scope, ...]
    ) -> Principal:
        """`presented`: the bearer token of the request, if it sent one; `scopes`: any
        one of them admits it."""
        return self._admit(Principal(await self._authenticate(presented, client), client),
                           scopes)

    async def authorize_session(
        self, session_id: str | None, client: str, scopes: tuple[Scope, ...]
    ) -> Principal:
        """As `authorize`, for the dashboard: `session_id` is its cookie's (auth off:
        ignored). Unauthorized when the session is missing, over, or its key revoked."""
        key = None
        if self.config.enabled:
            key = await self.sessions.find(session_id) if session_id else None
            if key is None:
                raise Unauthorized("this dashboard session is over: sign in again")
        return self._admit(Principal(key, client), scopes)

    async def sign_in(self, presented: str, client: str) -> str:
        """A dashboard session for the key `presented` (whatever its scopes: each page
        checks its own); returns the session's id. Unauthorized for a key that is not
        valid."""
        key = await self._authenticate(presented, client)
        self._limit(Principal(key, client))
        assert key is not None  # sign-in exists only with auth.enabled
        return await self.sessions.open(key)

    def _admit(self, principal: Principal, scopes: tuple[Scope, ...]) -> Principal:
        self._limit(principal)
        key = principal.key
        if key is not None and not any(key.allows(scope) for scope in scopes):
            raise Forbidden(
                f"API key {key.describe()} has scopes {', '.join(sorted(key.scopes))}; "
                f"this endpoint needs {' or '.join(scopes)}",
                code="insufficient_scope",
            )
        return principal

    async def _authenticate(self, presented: str | None, client: str) -> ApiKey | None:
        if not self.config.enabled:
            return None
        if not presented:
            raise Unauthorized(
                "this endpoint needs an API key: send Authorization: Bearer <key> "
                "(keys are made with `atropos keys create`)",
                field="Authorization",
            )
        key = await self._keys.verify(presented)
        if key is None:
            # The presented value is never logged: it may be a real key mistyped.
            log.info("refused a request from %s: not a valid API key", client)
            raise Unauthorized(
                "the API key is not valid (unknown, revoked or mistyped)", field="Authorization"
            )
        return key

    def _limit(self, principal: Principal) -> None:
        if self._limiter is None:
            return
        who = principal.key.key_id if principal.key else principal.client
        wait = self._limiter.take(who)
        if wait > 0:
            raise RateLimited(
                f"more than {self._limiter.rate:g} requests per second from "
                f"{principal.key.describe() if principal.key else principal.client}; "
                f"retry after {math.ceil(wait)} s",
                retry_after=math.ceil(wait),
                field="auth.rate_limit_per_second",
            )
