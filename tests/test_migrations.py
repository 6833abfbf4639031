"""Alembic owns the schema: every revision goes up and down on both databases, and an
upgrade never loses rows."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from app.config import TraceServerConfig
from app.db import migrate
from app.db.engine import create_engine
from app.db.models import Base


def revisions() -> list[str]:
    script = ScriptDirectory.from_config(migrate._alembic_config())
    return [rev.revision for rev in reversed(list(script.walk_revisions()))]


@pytest.fixture
async def engine(trace_server: dict[str, Any]) -> Any:
    engine = create_engine(TraceServerConfig(**trace_server))
    yield engine
    await engine.dispose()


async def tables(engine: Any) -> set[str]:
    async with engine.connect() as conn:
        return set(await conn.run_sync(lambda c: sa.inspect(c).get_table_names()))


async def test_empty_to_head_down_and_up_again(engine: Any) -> None:
    await migrate.upgrade(engine)
    assert await migrate.current_revision(engine) == migrate.head_revision()
    assert {"traces", "otlp_spans", "otlp_traces"} <= await tables(engine)
    await migrate.downgrade(engine, "base")
    assert await migrate.current_revision(engine) is None
    assert await tables(engine) <= {"alembic_version"}
    await migrate.upgrade(engine)
    assert await migrate.current_revision(engine) == migrate.head_revision()


async def test_each_revision_steps_up_and_down(engine: Any) -> None:
    for revision in revisions():
        await migrate.upgrade(engine, revision)
        assert await migrate.current_revision(engine) == revision
    for revision in reversed(revisions()[:-1]):
        await migrate.downgrade(engine, revision)
        assert await migrate.current_revision(engine) == revision


async def insert_trace(engine: Any, trace_id: str) -> None:
    """A row with the columns every revision has (reward 20)."""
    async with engine.begin() as conn:
        await conn.execute(sa.text(
            "INSERT INTO traces (trace_id, created_at, updated_at, status, stage, total_tokens,"
            " reward, source_format, content_hash, original, trace, attempts) VALUES (:id, "
            "'2026-01-01 00:00:00', '2026-01-01 00:00:00', 'success', 'accepted', 3, 20,"
            " 'native', 'h', '{}', '{}', 0)"), {"id": trace_id})


@pytest.mark.parametrize("start", revisions())
async def test_upgrade_from_every_revision_keeps_the_rows(engine: Any, start: str) -> None:
    await migrate.upgrade(engine, start)
    await insert_trace(engine, "kept")
    await migrate.upgrade(engine)
    async with engine.connect() as conn:
        assert await conn.scalar(sa.text("SELECT trace_id FROM traces")) == "kept"


async def test_the_otlp_tables_match_their_models(engine: Any) -> None:
    await migrate.upgrade(engine)
    async with engine.connect() as conn:
        diff = await conn.run_sync(
            lambda c: compare_metadata(MigrationContext.configure(c), Base.metadata)
        )
    assert [d for d in diff if "otlp_" in repr(d)] == []


async def columns(engine: Any, table: str) -> dict[str, dict[str, Any]]:
    async with engine.connect() as conn:
        found = await conn.run_sync(lambda c: sa.inspect(c).get_columns(table))
    return {column["name"]: column for column in found}


async def test_env_reward_comes_and_goes_with_0006_keeping_the_rows(engine: Any) -> None:
    assert revisions()[revisions().index("0005") + 1] == "0006"
    await migrate.upgrade(engine, "0005")
    assert "env_reward" not in await columns(engine, "traces")
    await insert_trace(engine, "old")
    await migrate.upgrade(engine)
    column = (await columns(engine, "traces"))["env_reward"]
    assert column["nullable"] and isinstance(column["type"], sa.Float)
    async with engine.begin() as conn:
        # Rows stored before keep everything and have no env_reward until `rescore`.
        old = (await conn.execute(sa.text("SELECT reward, env_reward FROM traces"))).one()
        assert tuple(old) == (20, None)
        await conn.execute(sa.text("UPDATE traces SET env_reward = 0.25"))
    await migrate.downgrade(engine, "0005")
    assert "env_reward" not in await columns(engine, "traces")
    async with engine.connect() as conn:
        assert (await conn.execute(sa.text("SELECT trace_id, reward FROM traces"))).one() == (
            "old", 20)
