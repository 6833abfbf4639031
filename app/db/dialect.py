"""Everything that differs between SQLite and PostgreSQL, in one place."""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any, Literal, assert_never

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

Dialect = Literal["sqlite", "postgresql"]


def dialect_of(conn: AsyncConnection | AsyncEngine | sa.Connection) -> Dialect:
    name = conn.dialect.name
    if name == "sqlite":
        return "sqlite"
    if name == "postgresql":
        return "postgresql"
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


def for_update(stmt: sa.Select[Any], dialect: Dialect) -> sa.Select[Any]:
    """SELECT ... FOR UPDATE: the rows read stay locked until commit (claiming work
    without waiting is `skip_locked`). SQLite has no row locks; a writer that began
    with `begin_immediate` already excludes every other writer."""
    if dialect == "postgresql":
        return stmt.with_for_update()
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


def skip_locked(select: sa.Select[Any], dialect: Dialect) -> sa.Select[Any]:
    """Rows another worker has locked are passed over, not waited for. SQLite has one
    writer at a time, so a single UPDATE ... WHERE id IN (SELECT ...) is atomic there
    without row locks."""
    if dialect == "postgresql":
        return select.with_for_update(skip_locked=True)
    if dialect == "sqlite":
        return select
    assert_never(dialect)


def reject_reason_counts(dialect: Dialect) -> sa.TextClause:
    """(filter, traces) over traces.reject_reasons, a JSON array of {"filter", ...}."""
    if dialect == "sqlite":
        return sa.text(
            "SELECT json_extract(r.value, '$.filter') AS name, count(*) AS n "
            "FROM traces, json_each(traces.reject_reasons) AS r "
            "WHERE traces.reject_reasons IS NOT NULL GROUP BY name"
        )
    if dialect == "postgresql":
        return sa.text(
            "SELECT r->>'filter' AS name, count(*) AS n "
            "FROM traces, jsonb_array_elements(traces.reject_reasons) AS r "
            "WHERE traces.reject_reasons IS NOT NULL GROUP BY name"
        )
    assert_never(dialect)


def rule_firing_counts(dialect: Dialect) -> sa.TextClause:
    """(rule, traces it fired on) over traces.reward_breakdown, a JSON object
    rule -> {"fired", "count", "points"}."""
    if dialect == "sqlite":
        return sa.text(
            "SELECT b.key AS name, count(*) AS n "
            "FROM traces, json_each(traces.reward_breakdown) AS b "
            "WHERE json_extract(b.value, '$.fired') = 1 GROUP BY name"
        )
    if dialect == "postgresql":
        return sa.text(
            "SELECT b.key AS name, count(*) AS n "
            "FROM traces, jsonb_each(traces.reward_breakdown) AS b "
            "WHERE (b.value->>'fired')::boolean GROUP BY name"
        )
    assert_never(dialect)
