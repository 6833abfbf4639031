"""Everything that differs between SQLite and PostgreSQL, in one place."""

from __future__ import annotations

from typing import Any, assert_never, Literal

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

Dialect = Literal["sqlite", "postgresql"]


def dialect_of(conn: AsyncConnection | sa.Connection) -> Dialect:
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


def skip_locked(select: sa.Select[Any], dialect: Dialect) -> sa.Select[Any]:
    """Rows another worker has locked are passed over, not waited for. SQLite has one
    writer at a time, so a single UPDATE ... WHERE id IN (SELECT ...) is atomic there
    without row locks."""
    if dialect == "postgresql":
        return select.with_for_update(skip_locked=True)
    if dialect == "sqlite":
        return select
    assert_never(dialect)


def picked_once(select: sa.Select[Any], dialect: Dialect) -> sa.CTE:
    """The rows a claim picks, as a CTE that the database evaluates exactly once.

    PostgreSQL may re-run `IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)` while it
    updates, and each re-run skips the rows the previous one locked, so a claim of n
    rows could take more; a MATERIALIZED CTE runs once. SQLite runs it once anyway."""
    picked = skip_locked(select, dialect).cte("picked")
    if dialect == "postgresql":
        return picked.prefix_with("MATERIALIZED")
    if dialect == "sqlite":
        return picked
    assert_never(dialect)
