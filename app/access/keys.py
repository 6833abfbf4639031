"""API keys: made by `atropos keys create`, presented as `Authorization: Bearer <key>`.

A key reads `ath_<key_id>_<secret>`. The key_id (12 hex characters) is not secret: it
finds the row, and names the key in `atropos keys list`/`revoke` and in log lines. The
secret is 32 random bytes (256 bits) from `secrets`; the database keeps only its
sha256, compared with `hmac.compare_digest` (constant time).

Why a plain sha256 and not bcrypt or argon2: slow hashes protect guessable passwords.
Against 256 random bits brute force is hopeless at any hash speed, while a slow hash
would cost every request milliseconds of CPU. What matters is that a copy of the
database (a backup, a `SELECT *`) holds nothing that opens the API.

Scopes: `ingest` (POST traces; Atropos environments), `read` (GET /v1/*), `train`
(Atropos trainers: /register, /batch), `review` (labels and reward overrides, the review
queue; it includes `read`, since a reviewer reads what it reviews), `admin` (destructive
and process-spawning endpoints; it includes the others).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db.models import API_KEYS as KEYS
from app.db.types import utcnow
from app.errors import NotFound

PREFIX = "ath"


class Scope(StrEnum):
    INGEST = "ingest"
    READ = "read"
    TRAIN = "train"
    REVIEW = "review"
    ADMIN = "admin"


# What a key holding each scope may do.
_INCLUDES: dict[Scope, frozenset[Scope]] = {
    Scope.INGEST: frozenset({Scope.INGEST}),
    Scope.READ: frozenset({Scope.READ}),
    Scope.TRAIN: frozenset({Scope.TRAIN}),
    Scope.REVIEW: frozenset({Scope.REVIEW, Scope.READ}),
    Scope.ADMIN: frozenset(Scope),
}


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str
    name: str
    scopes: frozenset[Scope]
    created_at: datetime
    revoked_at: datetime | None = None

    def allows(self, scope: Scope) -> bool:
        return any(scope in _INCLUDES[held] for held in self.scopes)

    def describe(self) -> str:
        """How log lines and error messages name a key: never with its secret."""
        return f"{self.name!r} ({self.key_id})"


def bearer_from_env(variable: str) -> dict[str, str]:
    """The Authorization header for the key in environment variable `variable` (none
    if it is unset): commands take keys from the environment, since `ps` shows
    command lines."""
    key = os.environ.get(variable, "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def split_key(key: str) -> tuple[str, str] | None:
    """(key_id, secret) of a well-formed key, else None."""
    prefix, _, rest = key.strip().partition("_")
    key_id, _, secret = rest.partition("_")
    if prefix != PREFIX or len(key_id) != 12 or not secret:
        return None
    if any(c not in "0123456789abcdef" for c in key_id):
        return None
    return key_id, secret


async def create_key(engine: AsyncEngine, name: str, scopes: set[Scope]) -> tuple[ApiKey, str]:
    """A new key; returns it with the full key string, which is never stored."""
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    key = ApiKey(key_id, name, frozenset(scopes), utcnow())
    async with engine.begin() as conn:
        await conn.execute(
            sa.insert(KEYS).values(
                key_id=key_id,
                name=name,
                scopes=sorted(scopes),
                secret_hash=hash_secret(secret),
                created_at=key.created_at,
            )
        )
    return key, f"{PREFIX}_{key_id}_{secret}"


async def list_keys(engine: AsyncEngine) -> list[ApiKey]:
    async with engine.connect() as conn:
        rows = await conn.execute(sa.select(KEYS).order_by(KEYS.c.created_at, KEYS.c.key_id))
        return [_key(row) for row in rows]


async def revoke_key(engine: AsyncEngine, key_id: str) -> ApiKey:
    """Revoked keys stay listed (who had access, until when); revoking twice is a no-op."""
    async with engine.begin() as conn:
        await conn.execute(
            sa.update(KEYS)
            .where(KEYS.c.key_id == key_id, KEYS.c.revoked_at.is_(None))
            .values(revoked_at=utcnow())
        )
        row = (await conn.execute(sa.select(KEYS).where(KEYS.c.key_id == key_id))).first()
    if row is None:
        raise NotFound(f"no API key with id {key_id!r}; see `atropos keys list`")
    return _key(row)


@dataclass(frozen=True, slots=True)
class _Cached:
    key: ApiKey | None  # None: no such key, or revoked
    secret_hash: str
    until: float


class KeyRing:
    """Verifies presented keys against the database, remembering each row for
    `cache_seconds` so that a busy client costs no lookup per request."""

    def __init__(self, engine: AsyncEngine, cache_seconds: float) -> None:
        self._engine = engine
        self._cache_seconds = cache_seconds
        self._cache: dict[str, _Cached] = {}

    async def verify(self, presented: str) -> ApiKey | None:
        """The key `presented` opens, or None (malformed, unknown, wrong secret, revoked)."""
        parts = split_key(presented)
        if parts is None:
            return None
        key_id, secret = parts
        entry = self._cache.get(key_id)
        if entry is None or entry.until < time.monotonic():
            entry = await self._load(key_id)
        # Compared even when the row is missing, so that timing says nothing either way.
        matches = hmac.compare_digest(hash_secret(secret), entry.secret_hash)
        return entry.key if matches else None

    async def active(self, key_id: str) -> ApiKey | None:
        """The key with this id, unless it is unknown or revoked (a dashboard session
        names its key by id)."""
        entry = self._cache.get(key_id)
        if entry is None or entry.until < time.monotonic():
            entry = await self._load(key_id)
        return entry.key

    async def _load(self, key_id: str) -> _Cached:
        async with self._engine.connect() as conn:
            row = (await conn.execute(sa.select(KEYS).where(KEYS.c.key_id == key_id))).first()
        if row is None:
            # Not cached: unknown ids must not fill memory.
            return _Cached(None, "0" * 64, 0)
        key = _key(row)
        entry = _Cached(
            key if key.revoked_at is None else None,
            row.secret_hash,
            time.monotonic() + self._cache_seconds,
        )
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[key_id] = entry
        return entry


def _key(row: sa.Row[tuple[object, ...]]) -> ApiKey:
    m = row._mapping
    return ApiKey(
        key_id=m["key_id"],
        name=m["name"],
        scopes=frozenset(Scope(s) for s in m["scopes"]),
        created_at=m["created_at"],
        revoked_at=m["revoked_at"],
    )
