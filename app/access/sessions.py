"""Dashboard sessions: what the dashboard's cookie holds instead of an API key.

Signing in at /ui/login checks the key once and opens a session: a random id (256 bits
from `secrets`) goes into the cookie, the database keeps its sha256, the key's id and
an expiry (`auth.session_hours`). Each page finds the session, then the key, which must
still be active: revoking the key (`atropos keys revoke`) closes its sessions, within
`auth.key_cache_seconds` as for bearer keys. Logging out revokes the session at once,
on every hub process sharing the database.

The id is not an API key and opens nothing but the dashboard: it lacks the `ath_` form,
so on /v1 it is refused like any mistyped key. A copy of the cookie (any other server on
the same host receives cookies meant for this one) is worth a dashboard session until
logout or expiry, never the key.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.access.keys import ApiKey, KeyRing
from app.db.models import DASHBOARD_SESSIONS as SESSIONS
from app.db.types import utcnow

# The shortest id the cookie may carry: anything shorter was never made here.
_MIN_ID = 32


def _hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


class Sessions:
    def __init__(self, engine: AsyncEngine, keys: KeyRing, lifetime: timedelta) -> None:
        self._engine = engine
        self._keys = keys
        self.lifetime = lifetime

    async def open(self, key: ApiKey) -> str:
        """A new session for `key`; returns its id (shown only to the cookie). Sessions
        that have ended are swept here, so the table holds about the live ones."""
        session_id = secrets.token_urlsafe(32)
        now = utcnow()
        async with self._engine.begin() as conn:
            await conn.execute(sa.delete(SESSIONS).where(
                (SESSIONS.c.expires_at < now) | SESSIONS.c.revoked_at.is_not(None)))
            await conn.execute(sa.insert(SESSIONS).values(
                session_hash=_hash(session_id), key_id=key.key_id, created_at=now,
                expires_at=now + self.lifetime))
        return session_id

    async def find(self, session_id: str) -> ApiKey | None:
        """The key of a session that is open (not expired, not logged out) and whose key
        is still active; else None."""
        if len(session_id) < _MIN_ID:
            return None
        async with self._engine.connect() as conn:
            key_id = (await conn.execute(
                sa.select(SESSIONS.c.key_id).where(
                    SESSIONS.c.session_hash == _hash(session_id),
                    SESSIONS.c.expires_at > utcnow(),
                    SESSIONS.c.revoked_at.is_(None),
                ))).scalar()
        return None if key_id is None else await self._keys.active(key_id)

    async def close(self, session_id: str) -> None:
        """Logout: the session opens nothing from now on."""
        async with self._engine.begin() as conn:
            await conn.execute(
                sa.update(SESSIONS)
                .where(SESSIONS.c.session_hash == _hash(session_id),
                       SESSIONS.c.revoked_at.is_(None))
                .values(revoked_at=utcnow()))
