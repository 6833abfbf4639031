"""One async engine per process, built from config.json's trace_server section."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

from app import files
from app.config import TraceServerConfig
from app.db.types import json_text
from app.errors import ConfigError


def database_url(cfg: TraceServerConfig) -> str:
    if cfg.storage_backend == "sqlite":
        return f"sqlite+aiosqlite:///{cfg.db_path}"
    if not cfg.database_url:
        raise ConfigError(
            "config.json: trace_server.database_url: required when storage_backend is "
            "postgresql (e.g. postgresql://user:pass@host:5432/atropos, or set "
            "ATROPOS_TRACE_SERVER__DATABASE_URL)"
        )
    try:
        url = make_url(cfg.database_url)
    except sa_exc.ArgumentError:
        # Not echoed: the value may hold a password.
        raise ConfigError(
            "config.json: trace_server.database_url: not a database URL; expected "
            "postgresql://user:pass@host:5432/atropos"
        ) from None
    if url.drivername.split("+")[0] not in ("postgresql", "postgres"):
        raise ConfigError(
            f"config.json: trace_server.database_url: {url.drivername}:// is not supported; "
            "use postgresql://user:pass@host:5432/atropos, or storage_backend sqlite"
        )
    if url.drivername != "postgresql+asyncpg":
        url = url.set(drivername="postgresql+asyncpg")
    return url.render_as_string(hide_password=False)


def redacted(url: str) -> str:
    """The URL as it may appear in a log line: never with its password."""
    return make_url(url).render_as_string(hide_password=True)


_JSON: dict[str, Any] = {
    "json_serializer": json_text,
    "json_deserializer": orjson.loads,
}


def create_engine(cfg: TraceServerConfig) -> AsyncEngine:
    url = database_url(cfg)

    if cfg.storage_backend == "sqlite":
        if Path(cfg.db_path).is_dir():
            raise ConfigError(
                f"config.json: trace_server.db_path: {cfg.db_path} is a directory; "
                f"name a file in it, e.g. {cfg.db_path}/atropos.db"
            )
        # Created here, private, so that SQLite (which gives its WAL and SHM files the
        # database file's mode) never makes a world-readable one.
        files.make_dir(Path(cfg.db_path).parent)
        files.create_missing(cfg.db_path)
        engine = create_async_engine(url, pool_size=8, max_overflow=8, **_JSON)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    engine = create_async_engine(url, pool_size=10, max_overflow=10, **_JSON)
    event.listen(engine.sync_engine, "checkin", _note_idle)
    event.listen(engine.sync_engine, "checkout", _ping_if_idle)
    return engine


# A pooled PostgreSQL connection idle for longer than this is pinged before use: the
# server may have restarted or dropped it meanwhile. SQLAlchemy's pool_pre_ping pinged
# at every checkout, a round trip of the event loop's CPU for every group commit. One
# that fails in use anyway (a restart under load) fails its operation with 503, and
# the pool replaces every connection older than the failure.
IDLE_BEFORE_PING_SECONDS = 5.0


def _note_idle(_dbapi_conn: Any, record: Any) -> None:
    if record is not None:
        record.info["idle_since"] = time.monotonic()


def _ping_if_idle(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
    since = record.info.get("idle_since")
    if since is None or time.monotonic() - since < IDLE_BEFORE_PING_SECONDS:
        return
    try:
        dbapi_conn.ping()
    except Exception:
        # The pool discards this connection and hands out a fresh one.
        raise sa_exc.DisconnectionError("the idle connection no longer answers") from None


def create_thread_engine(engine: AsyncEngine) -> sa.Engine:
    """A synchronous engine on the same SQLite file, with the same pragmas, for
    transactions run whole in one worker thread (`dialect.OneHop`)."""
    url = engine.url.set(drivername="sqlite")
    # One connection, used by one thread at a time (OneHop's own).
    sync = sa.create_engine(
        url,
        pool_size=1,
        max_overflow=0,
        connect_args={"check_same_thread": False},
        **_JSON,
    )
    event.listen(sync, "connect", _sqlite_pragmas)
    return sync


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    # 8 KB pages, PostgreSQL's size, for a database created now (an existing one keeps
    # its own: in WAL mode it cannot change). A 5 KB trace's row (its item and its
    # canonical trace) wastes less of its last page: the file is smaller
    # (docs/decisions.md).
    cursor.execute("PRAGMA page_size=8192")
    # A checkpoint every 4 MB of WAL, as SQLite's default of 1,000 pages made it with
    # 4 KB pages: it runs in the commit that crosses the mark, and holds it up for as
    # long as it copies.
    cursor.execute(f"PRAGMA wal_autocheckpoint={4 * 1024 * 1024 // 8192}")
    # WAL: readers never block the writer, and the API and workers can share the file.
    cursor.execute("PRAGMA journal_mode=WAL")
    # FULL: a commit is on disk before we acknowledge it (group commit pays the fsync
    # once per batch, so the cost is shared by many traces).
    cursor.execute("PRAGMA synchronous=FULL")
    # Other processes (workers, `atropos prune`) write too; wait for their lock
    # instead of failing at once.
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def sessionmaker(engine: AsyncEngine) -> async_sessionmaker[Any]:
    return async_sessionmaker(engine, expire_on_commit=False)
