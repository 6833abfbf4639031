"""Whose fault a database error is, decided in one place for both dialects.

A row the database refuses for what it holds (a value a column cannot take, a broken
constraint) is the client's: 422. Anything else is a condition of the hub that may
pass (a lock held by another process, a timeout, a full disk, a lost connection, a
restarting server): 503 with Retry-After, so that the client sends it again rather
than dropping it. A database that cannot be opened at start-up is one line saying
what failed and what to do (`unusable_database`).
"""

from __future__ import annotations

import sqlite3
import weakref

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import TraceServerConfig
from app.db.engine import database_url
from app.errors import HubError, Invalid, StartupError, Unavailable
from app.outage import Outage

# PostgreSQL SQLSTATE classes of what is wrong with the data: 22 data exception (a NUL
# in text or jsonb is 22P05), 23 integrity constraint violation.
_PG_ROW_CLASSES = ("22", "23")
# SQLite result codes of the same: too big, constraint, datatype mismatch.
_SQLITE_ROW_CODES = frozenset(
    {sqlite3.SQLITE_TOOBIG, sqlite3.SQLITE_CONSTRAINT, sqlite3.SQLITE_MISMATCH}
)


def refuses_row(exc: BaseException) -> bool:
    """Whether the database refused the row itself, not the write."""
    if isinstance(exc, IntegrityError | DataError):
        return True
    orig = exc.orig if isinstance(exc, DBAPIError) else None
    if isinstance(orig, sqlite3.Error):
        return orig.sqlite_errorcode & 0xFF in _SQLITE_ROW_CODES
    sqlstate = getattr(orig, "sqlstate", None)
    return isinstance(sqlstate, str) and sqlstate[:2] in _PG_ROW_CLASSES


def database_error(exc: SQLAlchemyError, retry_after: int = 1) -> HubError:
    """The answer for a failed database call."""
    detail = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    if refuses_row(exc):
        return Invalid(f"the database refused this: {detail}", code="refused_by_database")
    return Unavailable(
        f"the database is not available for this now ({type(detail).__name__}); retry",
        retry_after=retry_after,
    )


def database_outage() -> Outage:
    """The reporter of the database failing while the hub runs (app/outage.py)."""
    return Outage(
        "the database",
        "requests that need it get 503 and the stages wait",
        classify=_database_failure,
        logger="atropos.database",
    )


def _database_failure(exc: BaseException) -> tuple[str, str] | None:
    said = database_refusal(exc)
    return None if said is None else (failure_kind(exc), said)


_outages: weakref.WeakKeyDictionary[Engine, Outage] = weakref.WeakKeyDictionary()


def outage_of(engine: AsyncEngine) -> Outage:
    """The Outage of this engine's database, shared by everything using the engine."""
    outage = _outages.get(engine.sync_engine)
    if outage is None:
        outage = _outages[engine.sync_engine] = database_outage()
    return outage


def failure_kind(exc: BaseException) -> str:
    """A short name for what failed: the driver's own exception class (asyncpg has one
    per SQLSTATE) or SQLite's result code (SQLITE_BUSY, SQLITE_FULL, ...)."""
    cause: BaseException = exc.orig if isinstance(exc, DBAPIError) and exc.orig else exc
    for _ in range(5):  # SQLAlchemy's adapters wrap the driver's exception
        if cause.__cause__ is None:
            break
        cause = cause.__cause__
    name = getattr(cause, "sqlite_errorname", None)
    return name if isinstance(name, str) else type(cause).__name__


def database_refusal(exc: BaseException) -> str | None:
    """What the database said, in one line, when `exc` is the database refusing or
    failing a statement (locked, disk full, connection lost, no connection free): an
    expected condition, logged so. None for anything else: a bug, to be logged with
    its traceback."""
    if isinstance(exc, sa_exc.DBAPIError):
        # Not str(exc): that carries the statement and its parameters (trace contents).
        return f"{type(exc.orig).__name__}: {exc.orig}"
    if isinstance(exc, (sa_exc.TimeoutError, OSError)):
        return f"{type(exc).__name__}: {exc}"
    return None


def unusable_database(cfg: TraceServerConfig, exc: BaseException) -> StartupError | None:
    """One line saying why the database of `cfg` cannot be opened and what to do, when
    `exc` is the database (or its file, or its server) failing; None for anything
    else (a bug, to be shown with its traceback). The password is never in it."""
    reason = _reason(exc)
    if reason is None:
        return None
    if cfg.storage_backend == "sqlite":
        return StartupError(
            f"cannot open the SQLite database {cfg.db_path} ({reason}): "
            "check trace_server.db_path names a file in a writable directory"
        )
    url = make_url(database_url(cfg))
    where = f"{url.host or 'localhost'}:{url.port or 5432}"
    return StartupError(
        f"cannot reach PostgreSQL at {where} ({reason}): is it running? "
        "check trace_server.database_url"
    )


def _reason(exc: BaseException) -> str | None:
    """What went wrong, in a few words, without the statement or the URL."""
    if isinstance(exc, sa_exc.DBAPIError):
        exc = exc.orig if isinstance(exc.orig, BaseException) else exc
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, (TimeoutError, sa_exc.TimeoutError)):
        return "timed out"
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    if isinstance(exc, sa_exc.SQLAlchemyError) or _is_driver_error(exc):
        # asyncpg and sqlite3 messages name the role or file, never the password.
        return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    return None


def _is_driver_error(exc: BaseException) -> bool:
    """asyncpg's and sqlite3's own errors (raised before SQLAlchemy wraps them)."""
    module = type(exc).__module__
    return module.startswith(("asyncpg", "sqlite3", "aiosqlite"))
