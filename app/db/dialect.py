"""Everything that differs between SQLite and PostgreSQL, in one place."""

from __future__ import annotations

from typing import Any, Literal, assert_never

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

Dialect = Literal["sqlite", "postgresql"]


def dialect_of(conn: AsyncConnection | sa.Connection) -> Dialect:
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


def after_bulk_delete(dialect: Dialect, *, vacuum: bool) -> list[str]:
    """Statements to run (outside a transaction) after deleting many traces.

    SQLite: VACUUM gives the freed pages back to the file system (it rewrites the file
    and holds the write lock meanwhile, hence optional); ANALYZE refreshes the planner's
    statistics. PostgreSQL: autovacuum reclaims the space without locking the table
    (VACUUM FULL would lock it), so only ANALYZE."""
    if dialect == "sqlite":
        return (["VACUUM"] if vacuum else []) + ["ANALYZE"]
    if dialect == "postgresql":
        return ["ANALYZE traces"]
    assert_never(dialect)
