"""Bring any database to the current schema revision. Every command that opens the
database calls `upgrade` first.

A database already at the head (the usual start) costs one SELECT: the head is read
from the revision files' `revision` / `down_revision` assignments, and alembic, whose
import alone is a third of a second and more (it pulls in mako and pygments), is
imported only when there is something to migrate. A hub that restarts must answer
within a second. `open_database` and `database` open a config's database, migrated,
for every command and the hub, without importing the hub."""

from __future__ import annotations

import ast
import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

import migrations
from app import files
from app.config import HubConfig
from app.db.dialect import migration_lock
from app.db.engine import create_engine, database_url, redacted
from app.db.errors import unusable_database

log = logging.getLogger("atropos")

if TYPE_CHECKING:
    from alembic.config import Config

_VERSIONS = Path(migrations.__file__).parent / "versions"


def _alembic_config(sync_conn: sa.Connection | None = None) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    cfg.attributes["connection"] = sync_conn
    return cfg


def head_revision() -> str:
    """The revision(s) the code expects, as `current_revision` reports them."""
    return ",".join(sorted(_heads()))


@cache
def _heads() -> frozenset[str]:
    """Revisions no other revision builds on, from the files alembic reads."""
    revisions: set[str] = set()
    parents: set[str] = set()
    for path in _VERSIONS.glob("*.py"):
        names = _assignments(path)
        if isinstance(names.get("revision"), str):
            revisions.add(names["revision"])
            down = names.get("down_revision")
            parents.update([down] if isinstance(down, str) else down or ())
    return frozenset(revisions - parents)


def _assignments(path: Path) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id in ("revision", "down_revision"):
                values[target.id] = ast.literal_eval(node.value)
    return values


async def upgrade(engine: AsyncEngine, revision: str = "heads") -> None:
    """To `revision`; by default every head (the history is linear, but a branch that
    adds tables on its own must not block start-up)."""
    if revision == "heads" and await current_revision(engine) == head_revision():
        return
    async with engine.begin() as conn:
        await conn.run_sync(_upgrade, revision)


async def downgrade(engine: AsyncEngine, revision: str) -> None:
    from alembic import command

    async with engine.begin() as conn:
        await conn.run_sync(lambda c: command.downgrade(_alembic_config(c), revision))


async def current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        heads = await conn.run_sync(_current_heads)
    return ",".join(sorted(heads)) or None


def _current_heads(conn: sa.Connection) -> list[str]:
    if not sa.inspect(conn).has_table("alembic_version"):
        return []
    return list(conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars())


def _upgrade(sync_conn: sa.Connection, revision: str) -> None:
    from alembic import command

    migration_lock(sync_conn)
    command.upgrade(_alembic_config(sync_conn), revision)


async def open_database(config: HubConfig) -> AsyncEngine:
    """The engine, with the schema brought to the current revision first. A database
    that cannot be opened stops start-up with one line (`unusable_database`)."""
    files.use_group(config.trace_server.file_group)
    engine: AsyncEngine | None = None
    try:
        engine = create_engine(config.trace_server)
        log.info("database %s", redacted(database_url(config.trace_server)))
        await upgrade(engine)
    except asyncio.CancelledError:
        # Ctrl-C mid-migration: the connection's thread may still be running a
        # statement; disposing waits for it, so that it never answers a closed loop.
        if engine is not None:
            await engine.dispose()
        raise
    except Exception as exc:
        if engine is not None:
            await engine.dispose()
        unusable = unusable_database(config.trace_server, exc)
        if unusable is None:
            raise
        raise unusable from exc
    return engine


@asynccontextmanager
async def database(config: HubConfig) -> AsyncIterator[AsyncEngine]:
    """The database of `config`, migrated (open_database), for as long as the block
    runs; the engine is disposed of at its end."""
    engine = await open_database(config)
    try:
        yield engine
    finally:
        await engine.dispose()
