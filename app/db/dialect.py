"""Everything that differs between SQLite and PostgreSQL, in one place."""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any, assert_never, Literal

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

Dialect = Literal["sqlite", "postgresql"]


def dialect_of(conn: AsyncConnection | AsyncEngine | sa.Connection) -> Dialect:
    name = conn.dialect.name
    if name == "sqlite" or name == "postgresql":
        return name
    raise ValueError(f"unsupported database dialect {name!r}")


def insert_ignoring_conflicts(dialect: Dialect, table: sa.Table, key: str) -> Any:
    """INSERT ... ON CONFLICT (key) DO NOTHING: an idempotent insert whose RETURNING
    lists only the rows that were new."""
    if dialect == "sqlite":
        return sqlite.insert(table).on_conflict_do_nothing(index_elements=[key])
    if dialect == "postgresql":
        return postgresql.insert(table).on_conflict_do_nothing(index_elements=[key])
    assert_never(dialect)


def migration_lock(sync_conn: sa.Connection) -> None:
    """Serialise concurrent `atropos db upgrade` runs (several hubs starting at once).

    PostgreSQL: a transaction-scoped advisory lock. SQLite: BEGIN IMMEDIATE already
    gives the migrating connection the single writer lock."""
    dialect = dialect_of(sync_conn)
    if dialect == "postgresql":
        sync_conn.execute(sa.text("SELECT pg_advisory_xact_lock(7160513)"))
    elif dialect == "sqlite":
        pass
    else:
        assert_never(dialect)


async def begin_immediate(conn: AsyncConnection) -> None:
    """Make the transaction just begun on `conn` a writer before it reads anything,
    so that its reads and the writes that depend on them are not interleaved with
    another writer's.

    SQLite: BEGIN IMMEDIATE takes the database's single write lock now (a deferred
    transaction would take it at its first write, after reads another process may
    since have invalidated). PostgreSQL: nothing here; callers lock the rows they
    depend on (`for_update`)."""
    dialect = dialect_of(conn)
    if dialect == "sqlite":
        # pysqlite issues no BEGIN of its own while one is open, and commits this one.
        await conn.exec_driver_sql("BEGIN IMMEDIATE")
    elif dialect == "postgresql":
        pass
    else:
        assert_never(dialect)


def for_update(dialect: Dialect, stmt: sa.Select[Any], *, skip_locked: bool = False) -> Any:
    """SELECT ... FOR UPDATE [SKIP LOCKED]: lock the rows read until commit, or with
    skip_locked pass over rows another process holds (claiming work).

    SQLite has no row locks; the writer that began with `begin_immediate` already
    excludes every other writer, so the plain SELECT is the claim."""
    if dialect == "postgresql":
        return stmt.with_for_update(skip_locked=skip_locked)
    if dialect == "sqlite":
        return stmt
    assert_never(dialect)


def writer_lock(dialect: Dialect) -> AbstractAsyncContextManager[Any]:
    """The in-process lock around write transactions.

    SQLite: one writer at a time anyway; queueing our own writers on an asyncio.Lock
    spares them SQLite's busy-wait sleeps. PostgreSQL: none (row locks decide)."""
    if dialect == "sqlite":
        return asyncio.Lock()
    if dialect == "postgresql":
        return nullcontext()
    assert_never(dialect)
