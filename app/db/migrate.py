"""Bring any database to the current schema revision. Every command that opens the
database calls `upgrade` first."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.ext.asyncio import AsyncEngine

import migrations
from app.db.dialect import migration_lock


def _alembic_config(sync_conn: sa.Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    cfg.attributes["connection"] = sync_conn
    return cfg


def head_revision() -> str:
    """The revision(s) the code expects, as `current_revision` reports them."""
    heads = ScriptDirectory.from_config(_alembic_config()).get_heads()
    return ",".join(sorted(heads))


async def upgrade(engine: AsyncEngine, revision: str = "heads") -> None:
    """To `revision`; by default every head (the history is linear, but a branch that
    adds tables on its own must not block start-up)."""
    async with engine.begin() as conn:
        await conn.run_sync(_upgrade, revision)


async def downgrade(engine: AsyncEngine, revision: str) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(lambda c: command.downgrade(_alembic_config(c), revision))


async def current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        heads = await conn.run_sync(
            lambda c: MigrationContext.configure(c).get_current_heads()
        )
    return ",".join(sorted(heads)) or None


def _upgrade(sync_conn: sa.Connection, revision: str) -> None:
    migration_lock(sync_conn)
    command.upgrade(_alembic_config(sync_conn), revision)
