"""The test databases: a SQLite file, or a fresh database on the PostgreSQL cluster
named by ATROPOS_TEST_DATABASE_URL (CI always provides it); and reading and writing
them directly, as a user with sqlite3/psql would, or as a test setting up a state."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import asyncpg
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import TraceServerConfig
from app.db.engine import create_engine

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


class EmptyPgDatabases:
    """Fresh, empty PostgreSQL databases for tests, reused: CREATE DATABASE takes about a
    second, emptying one a few milliseconds. A database given back is emptied when it
    is next taken (by then the hubs of the test that gave it back have stopped: a
    test's teardown ends before the next test's setup begins); all are dropped when
    the session ends."""

    def __init__(self) -> None:
        self._created: list[str] = []
        self._given_back: list[str] = []

    def take(self) -> str:
        if not self._given_back:
            self._created.append(create_pg_database())
            return self._created[-1]
        url = self._given_back.pop()
        asyncio.run(_empty(url))
        return url

    def give_back(self, url: str) -> None:
        self._given_back.append(url)

    def drop_all(self) -> None:
        for url in self._created:
            drop_pg_database(url)
        self._created, self._given_back = [], []


async def _empty(url: str) -> None:
    """Everything the hub and its migrations make lives in the public schema."""
    conn = await asyncpg.connect(make_url(url).set(drivername="postgresql").render_as_string(
        hide_password=False))
    try:
        await conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                           "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        await conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
    finally:
        await conn.close()


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
