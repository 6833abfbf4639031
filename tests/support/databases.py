"""The test databases: a SQLite file, or a fresh database on the PostgreSQL cluster
named by ATROPOS_TEST_DATABASE_URL (CI always provides it); and reading and writing
them directly, as a user with sqlite3/psql would, or as a test setting up a state."""

from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, closing, contextmanager
from pathlib import Path
from typing import Any

import asyncpg
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import TraceServerConfig
from app.db.engine import create_engine
from app.db.migrate import upgrade

PG_ADMIN_URL = os.environ.get("ATROPOS_TEST_DATABASE_URL")


def create_pg_database() -> str:
    assert PG_ADMIN_URL
    name = f"t_{uuid.uuid4().hex[:12]}"
    _pg_admin(f'CREATE DATABASE "{name}"')
    return make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)


def drop_pg_database(url: str) -> None:
    name = make_url(url).database
    _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def allow_pg_connections(url: str, allowed: bool) -> None:
    """A PostgreSQL database lost to its clients (its connections cut, new ones
    refused), or back; as when the server restarts or the network fails."""
    name = make_url(url).database
    _pg_admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(allowed).lower()}')
    if not allowed:
        _pg_admin(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")


class PgDatabases:
    """Fresh PostgreSQL databases for tests, reused: CREATE DATABASE takes about a
    second, and migrating an empty one a quarter; emptying one's tables takes a few
    milliseconds. `take(migrated=True)`: at the current schema, every table empty;
    `take(migrated=False)`: an empty schema, for the tests of the migrations. A
    database given back is reset when it is next taken (by then the hubs of the test
    that gave it back have stopped: a test's teardown ends before the next test's setup
    begins); all are dropped when the session ends."""

    def __init__(self) -> None:
        self._created: list[str] = []
        self._given_back: list[str] = []
        self._schema: list[Any] | None = None  # the migrated schema, as `_schema` reads it
        self._seeded: dict[str, list[asyncpg.Record]] = {}  # the rows migrations insert

    def take(self, *, migrated: bool = True) -> str:
        if self._given_back:
            url = self._given_back.pop()
        else:
            self._created.append(url := create_pg_database())
        asyncio.run(self._reset(url, migrated))
        return url

    def give_back(self, url: str) -> None:
        self._given_back.append(url)

    def drop_all(self) -> None:
        for url in self._created:
            drop_pg_database(url)
        self._created, self._given_back = [], []

    async def _reset(self, url: str, migrated: bool) -> None:
        """The rows a test left go; so does the schema, unless it is the one the
        migrations make (a test may have changed it: dropped a table, stepped down)."""
        conn = await asyncpg.connect(_driver_url(url))
        try:
            await conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                               "WHERE datname = current_database() AND pid <> pg_backend_pid()")
            if migrated and self._schema is not None and await _schema(conn) == self._schema:
                tables = ", ".join(f'"{table}"' for table in await _tables(conn))
                async with conn.transaction():
                    await conn.execute(f"TRUNCATE {tables} RESTART IDENTITY CASCADE")
                    for table, rows in self._seeded.items():
                        await conn.copy_records_to_table(table, records=rows,
                                                         columns=list(rows[0].keys()))
                return
            # Everything the hub and its migrations make lives in the public schema.
            await conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
            if not migrated:
                return
            await migrate_database({"storage_backend": "postgresql", "database_url": url})
            if self._schema is None:
                self._schema = await _schema(conn)
                for table in await _tables(conn):
                    if rows := await conn.fetch(f'SELECT * FROM "{table}"'):
                        self._seeded[table] = rows
        finally:
            await conn.close()


async def _schema(conn: asyncpg.Connection) -> list[Any]:
    """The revision, the columns, the indexes and the triggers of the public schema
    ([] before any migration)."""
    read = []
    for query in (
        "SELECT version_num FROM alembic_version",
        "SELECT table_name, column_name, data_type, is_nullable, column_default "
        "FROM information_schema.columns WHERE table_schema = 'public' ORDER BY 1, 2",
        "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY 1",
        "SELECT tgname, tgrelid::regclass::text FROM pg_trigger WHERE NOT tgisinternal "
        "ORDER BY 1",
    ):
        try:
            read.append([tuple(r) for r in await conn.fetch(query)])
        except asyncpg.UndefinedTableError:
            return []
    return read


async def _tables(conn: asyncpg.Connection) -> list[str]:
    """The public schema's tables but alembic's."""
    return [r["tablename"] for r in await conn.fetch(
        "SELECT tablename FROM pg_tables WHERE schemaname = 'public' "
        "AND tablename <> 'alembic_version' ORDER BY 1")]


def _driver_url(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


async def migrate_database(trace_server: dict[str, Any]) -> None:
    """Bring the database of a `trace_server` section to the current schema, as the
    hub does when it starts."""
    async with database(trace_server) as engine:
        await upgrade(engine)


class SqliteTemplate:
    """A SQLite file migrated once per test process, copied for each test that wants a
    database at the current schema: migrating an empty file takes a fifth of a
    second, a copy a millisecond."""

    def __init__(self) -> None:
        self._path: Path | None = None

    def copy_to(self, path: Path) -> None:
        if self._path is None:
            template = Path(tempfile.mkdtemp(prefix="atropos-template-")) / "traces.db"
            asyncio.run(migrate_database({"storage_backend": "sqlite",
                                          "db_path": str(template)}))
            with closing(sqlite3.connect(template)) as conn:  # all of it in the one file
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._path = template
        shutil.copyfile(self._path, path)

    def remove(self) -> None:
        if self._path is not None:
            shutil.rmtree(self._path.parent, ignore_errors=True)
            self._path = None


def _pg_admin(sql: str) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(PG_ADMIN_URL)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run())


@asynccontextmanager
async def database(trace_server: dict[str, Any]) -> AsyncIterator[AsyncEngine]:
    """An engine on the database of a `trace_server` config section."""
    engine = create_engine(TraceServerConfig.model_validate(trace_server))
    try:
        yield engine
    finally:
        await engine.dispose()


def db_execute(trace_server: dict[str, Any], statement: str | sa.Executable,
               **params: Any) -> list[dict[str, Any]]:
    """Run one statement on the test database (either dialect) from a sync test, as a
    user with sqlite3/psql would; returns the rows, if any."""
    if isinstance(statement, str):
        statement = sa.text(statement)

    async def run() -> list[dict[str, Any]]:
        async with database(trace_server) as engine, engine.begin() as conn:
            result = await conn.execute(statement, params)
            return [dict(row._mapping) for row in result] if result.returns_rows else []

    return asyncio.run(run())


def make_api_key(trace_server: dict[str, Any], *scopes: str, name: str = "test") -> str:
    """An API key made directly in the database a hub uses (`atropos keys create` has
    its own test); returns the key to send as `Authorization: Bearer <key>`."""
    from app.access.keys import Scope, create_key

    async def make() -> str:
        async with database(trace_server) as engine:
            return (await create_key(engine, name, {Scope(s) for s in scopes}))[1]

    return asyncio.run(make())


@contextmanager
def write_lock(trace_server: dict[str, Any], table: str = "traces") -> Iterator[None]:
    """Hold the lock the hub needs to insert traces (or rows of `table`), as another
    process would (a long `atropos prune`, a psql session); readers are not blocked."""
    if trace_server["storage_backend"] == "sqlite":
        conn = sqlite3.connect(trace_server["db_path"], isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            conn.execute("ROLLBACK")
            conn.close()
        return
    locked, release = threading.Event(), threading.Event()

    async def hold() -> None:
        conn = await asyncpg.connect(trace_server["database_url"])
        try:
            async with conn.transaction():
                await conn.execute(f"LOCK TABLE {table} IN EXCLUSIVE MODE")
                locked.set()
                await asyncio.get_running_loop().run_in_executor(None, release.wait)
        finally:
            await conn.close()

    holder = threading.Thread(target=asyncio.run, args=(hold(),))
    holder.start()
    assert locked.wait(10)
    try:
        yield
    finally:
        release.set()
        holder.join(10)
