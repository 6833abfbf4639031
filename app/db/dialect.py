"""Everything that differs between SQLite and PostgreSQL, in one place."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar, assert_never
from weakref import WeakKeyDictionary

import orjson
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.db.engine import create_thread_engine
from app.db.types import EncodedJSON, UtcTimeStamp, utc_text

Dialect = Literal["sqlite", "postgresql"]
T = TypeVar("T")


def dialect_of(conn: AsyncConnection | AsyncEngine | sa.Connection) -> Dialect:
    name = conn.dialect.name
    if name == "sqlite":
        return "sqlite"
    if name == "postgresql":
        return "postgresql"
    raise ValueError(f"unsupported database dialect {name!r}")


def insert(dialect: Dialect, table: sa.Table) -> Any:
    """The dialect's own INSERT, which has ON CONFLICT (`on_conflict_do_nothing`,
    `on_conflict_do_update`) with the same signature on both."""
    if dialect == "sqlite":
        return sqlite.insert(table)
    if dialect == "postgresql":
        return postgresql.insert(table)
    assert_never(dialect)


def insert_ignoring_conflicts(dialect: Dialect, table: sa.Table, *key: str) -> Any:
    """INSERT ... ON CONFLICT (key) DO NOTHING: an idempotent insert whose RETURNING
    lists only the rows that were new."""
    return insert(dialect, table).on_conflict_do_nothing(index_elements=list(key))


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


def begin_immediate(conn: sa.Connection) -> None:
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
        conn.exec_driver_sql("BEGIN IMMEDIATE")
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


def reserve_ids(conn: sa.Connection, table: sa.Table, n: int) -> list[int]:
    """n new values of `table`'s autoincrementing integer key, to insert rows whose
    ids must be known beforehand without a RETURNING per row (an ordered RETURNING
    makes SQLAlchemy insert SQLite rows one statement at a time).

    SQLite: max + 1 onwards; only valid inside a `begin_immediate` transaction,
    whose write lock keeps anyone else from taking the same ids. PostgreSQL: values
    drawn from the column's own sequence, unique across sessions."""
    dialect = dialect_of(conn)
    key = table.c.id
    if dialect == "sqlite":
        top = conn.scalar(sa.select(sa.func.coalesce(sa.func.max(key), 0)))
        first = int(top or 0) + 1
        return list(range(first, first + n))
    if dialect == "postgresql":
        sequence = sa.func.pg_get_serial_sequence(table.name, key.name)
        rows = conn.execute(
            sa.select(sa.func.nextval(sequence)).select_from(sa.func.generate_series(1, n))
        )
        return [int(value) for value in rows.scalars()]
    assert_never(dialect)


class BulkInsert:
    """INSERT ... ON CONFLICT (key) DO NOTHING of many rows, its SQL written once per
    dialect, with values in a form both drivers take as they are (`values`): text,
    numbers and None, a UtcTimeStamp as SQLite's UTC text, JSON as its text. No
    SQLAlchemy type processing runs per row, and the values can be made anywhere
    (the ingest processes make them) before the dialect is known.

    `run` inserts the rows whose key is new and answers those keys. SQLite: the keys
    already there are looked up first, then the rest go in one executemany; only valid
    in a transaction begun IMMEDIATE (`OneHop`), whose write lock keeps what the lookup
    found true until commit. PostgreSQL: one statement over the columns as arrays
    (unnest), RETURNING the keys it inserted; concurrent writers are settled by the
    conflict clause.

    `replace`: a row whose key is stored already replaces the stored values instead
    (ON CONFLICT DO UPDATE), and `run` answers every key; on both databases one
    statement, with no lookup before it."""

    def __init__(
        self, table: sa.Table, key: str, columns: Sequence[str], *, replace: bool = False
    ) -> None:
        self.table = table
        self.key = key
        self.columns = tuple(columns)
        self._replace = replace
        self._key_index = self.columns.index(key)
        types = [table.c[name].type for name in self.columns]
        self._times = {i for i, t in enumerate(types) if isinstance(t, UtcTimeStamp)}
        self._json = {i for i, t in enumerate(types) if isinstance(t, sa.JSON)}
        names = ", ".join(self.columns)
        conflict = f"ON CONFLICT ({key}) DO NOTHING"
        if replace:
            conflict = f"ON CONFLICT ({key}) DO UPDATE SET " + ", ".join(
                f"{name} = excluded.{name}" for name in self.columns if name != key)
        self._sqlite = (
            f"INSERT INTO {table.name} ({names}) VALUES ({', '.join('?' * len(types))}) "
            f"{conflict}"
        )
        # The keys among those of a JSON array that the table holds already.
        self._sqlite_there = (
            f"SELECT {key} FROM {table.name} WHERE {key} IN (SELECT value FROM json_each(?))"
        )
        arrays, selected = [], []
        for i, (name, kind) in enumerate(zip(self.columns, types, strict=True)):
            arrays.append(f"${i + 1}::{_pg_array_of(kind, i in self._times | self._json)}[]")
            if i in self._times:
                selected.append(f"{name}::timestamp AT TIME ZONE 'UTC'")
            elif i in self._json:
                selected.append(f"{name}::jsonb")
            else:
                selected.append(name)
        self._postgresql = (
            f"INSERT INTO {table.name} ({names}) SELECT {', '.join(selected)} "
            f"FROM unnest({', '.join(arrays)}) AS v({names}) "
            f"{conflict} RETURNING {key}"
        )

    def values(self, row: Mapping[str, Any]) -> tuple[Any, ...]:
        """The row's values, in `columns` order, in the form `run` takes."""
        values = []
        for i, name in enumerate(self.columns):
            value = row[name]
            if value is None:
                pass
            elif i in self._times:
                assert isinstance(value, datetime)
                value = utc_text(value)
            elif i in self._json:
                value = value.text if isinstance(value, EncodedJSON) else (
                    orjson.dumps(value).decode())
            values.append(value)
        return tuple(values)

    def row(self, values: Sequence[Any]) -> dict[str, Any]:
        """`values` back as column -> value in the form SQLAlchemy's types take (the
        inverse of `values`), for statements that go through them."""
        row: dict[str, Any] = {}
        for i, (name, value) in enumerate(zip(self.columns, values, strict=True)):
            if value is not None and i in self._times:
                value = datetime.fromisoformat(value).replace(tzinfo=UTC)
            elif value is not None and i in self._json:
                value = EncodedJSON(value)
            row[name] = value
        return row

    def run(self, conn: sa.Connection, rows: Sequence[tuple[Any, ...]]) -> set[Any]:
        """Insert `rows` (from `values`, with distinct keys); the keys that were new."""
        if not rows:
            return set()
        k = self._key_index
        dialect = dialect_of(conn)
        if dialect == "sqlite":
            if self._replace:
                conn.exec_driver_sql(self._sqlite, list(rows))
                return {row[k] for row in rows}
            keys = orjson.dumps([row[k] for row in rows]).decode()
            there = set(conn.exec_driver_sql(self._sqlite_there, (keys,)).scalars())
            new = [row for row in rows if row[k] not in there]
            if new:
                conn.exec_driver_sql(self._sqlite, new)
            return {row[k] for row in new}
        if dialect == "postgresql":
            arrays = tuple(list(column) for column in zip(*rows, strict=True))
            return set(conn.exec_driver_sql(self._postgresql, arrays).scalars())
        assert_never(dialect)


def _pg_array_of(kind: Any, as_text: bool) -> str:
    """The PostgreSQL element type of a column's values in BulkInsert's form."""
    if as_text or isinstance(kind, sa.String | sa.Text):
        return "text"
    if isinstance(kind, sa.Integer):
        return "bigint"
    if isinstance(kind, sa.Float):
        return "float8"
    raise TypeError(f"BulkInsert does not know how to pass {kind!r} to PostgreSQL")


# Each engine's turn at writing, on SQLite (with the event loop it belongs to).
_TURNS: WeakKeyDictionary[sa.Engine, tuple[asyncio.AbstractEventLoop, asyncio.Lock]] = (
    WeakKeyDictionary())


def write_turn(engine: AsyncEngine) -> AbstractAsyncContextManager[Any]:
    """The turn of this process's writers to one SQLite database: the group commits
    (`OneHop`) and the background stages' transactions (`writing`) take it, so that they
    wait for each other in the event loop, in order, instead of in SQLite's busy
    handler, which sleeps by growing steps (up to 100 ms) while the other keeps the
    lock. PostgreSQL locks rows, not the database: no turn there."""
    if dialect_of(engine) != "sqlite":
        return nullcontext()
    loop = asyncio.get_running_loop()
    held = _TURNS.get(engine.sync_engine)
    if held is None or held[0] is not loop:
        held = _TURNS[engine.sync_engine] = (loop, asyncio.Lock())
    return held[1]


@asynccontextmanager
async def writing(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """`engine.begin()` in the write turn (`write_turn`): a write transaction of the
    background stages."""
    async with write_turn(engine), engine.begin() as conn:
        yield conn


class OneHop:
    """Write transactions run whole, with one wait on the event loop.

    SQLite: aiosqlite hands every statement to its thread and back several times
    (cursor, execute, fetch, close), and on a busy event loop each trip waits its
    turn, so a commit of a few statements took tens of milliseconds under load. Here
    the transaction runs on a plain sqlite3 connection in a thread of its own, begun
    IMMEDIATE. PostgreSQL: asyncpg already costs one round trip per statement; the
    work runs through run_sync on a pooled connection.

    `work` is a synchronous function of a Connection; it must not touch the event
    loop (it may run in another thread).

    `synced=False`: the commit returns before its pages reach the disk (SQLite's
    `synchronous=NORMAL` for that transaction, PostgreSQL's `synchronous_commit =
    off`). It still survives the hub's kill -9 (the pages are the system's), not a
    power cut before the next synced commit or checkpoint."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._dialect = dialect_of(engine)
        self._thread: ThreadPoolExecutor | None = None
        self._sync: sa.Engine | None = None

    async def run(self, work: Callable[[sa.Connection], T], *, synced: bool = True) -> T:
        if self._dialect == "sqlite":
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="sqlite-one-hop")
            loop = asyncio.get_running_loop()
            async with write_turn(self._engine):
                return await loop.run_in_executor(self._thread, self._in_thread, work, synced)
        if self._dialect == "postgresql":
            async with self._engine.begin() as conn:
                if not synced:
                    await conn.exec_driver_sql("SET LOCAL synchronous_commit TO OFF")
                return await conn.run_sync(work)
        assert_never(self._dialect)

    def _in_thread(self, work: Callable[[sa.Connection], T], synced: bool) -> T:
        if self._sync is None:
            self._sync = create_thread_engine(self._engine)
        with self._sync.connect() as conn:
            # SQLite takes the safety level only between transactions: on the driver's
            # connection, which the pragma does not begin one on.
            driver = conn.connection.dbapi_connection
            assert driver is not None
            if not synced:
                driver.execute("PRAGMA synchronous=NORMAL")
            try:
                with conn.begin():
                    begin_immediate(conn)
                    return work(conn)
            finally:
                if not synced:
                    driver.execute("PRAGMA synchronous=FULL")

    async def close(self) -> None:
        if self._thread is None:
            return
        if self._sync is not None:
            await asyncio.get_running_loop().run_in_executor(self._thread, self._sync.dispose)
        self._thread.shutdown()
        self._thread = None


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


def time_bucket(dialect: Dialect, column: sa.ColumnElement[Any], seconds: int) -> Any:
    """The start of the `seconds`-wide bucket a timestamp falls in, as Unix seconds."""
    if dialect == "sqlite":
        # Stored as 'YYYY-MM-DD HH:MM:SS.ffffff' UTC (app/db/types.py UtcTimeStamp).
        epoch = sa.cast(sa.func.strftime("%s", column), sa.Integer)
        return (epoch // seconds) * seconds
    if dialect == "postgresql":
        return sa.func.floor(sa.extract("epoch", column) / seconds) * seconds
    assert_never(dialect)


def rejected_by_filter(dialect: Dialect, name: str) -> sa.ColumnElement[bool]:
    """Traces whose reject_reasons (a JSON array of {"filter", ...}) name filter `name`."""
    reasons: sa.ColumnElement[Any] = sa.literal_column("traces.reject_reasons")  # outer row
    if dialect == "sqlite":
        return sa.exists(
            sa.select(sa.literal(1))
            .select_from(sa.func.json_each(reasons))
            .where(sa.func.json_extract(sa.literal_column("value"), "$.filter") == name)
        )
    if dialect == "postgresql":
        return reasons.bool_op("@>")(
            sa.func.jsonb_build_array(sa.func.jsonb_build_object("filter", name))
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


def redaction_counts(dialect: Dialect) -> sa.TextClause:
    """(kind, secrets redacted) over the canonical traces' metadata.redactions (in
    trace_payloads), a JSON object kind -> count written by the ingest path
    (app/evaluation/redaction.py)."""
    if dialect == "sqlite":
        return sa.text(
            "SELECT r.key AS name, sum(r.value) AS n "
            "FROM trace_payloads AS p, json_each(p.trace, '$.metadata.redactions') AS r "
            "WHERE r.type = 'integer' GROUP BY name"
        )
    if dialect == "postgresql":
        return sa.text(
            "SELECT r.key AS name, sum((r.value #>> '{}')::bigint) AS n "
            "FROM trace_payloads AS p, jsonb_each(p.trace -> 'metadata' -> 'redactions') AS r "
            "WHERE jsonb_typeof(r.value) = 'number' GROUP BY name"
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
