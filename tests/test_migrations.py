"""Alembic owns the schema: every revision goes up and down on both databases, and an
upgrade never loses rows."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.script import ScriptDirectory

from app.config import TraceServerConfig
from app.db import migrate
from app.db.engine import create_engine


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
    assert "traces" in await tables(engine)
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


@pytest.mark.parametrize("start", revisions())
async def test_upgrade_from_every_revision_keeps_the_rows(engine: Any, start: str) -> None:
    await migrate.upgrade(engine, start)
    async with engine.begin() as conn:
        await conn.execute(sa.text(
            "INSERT INTO traces (trace_id, created_at, updated_at, status, stage, total_tokens,"
            " source_format, content_hash, original, trace, attempts) VALUES ('kept', "
            "'2026-01-01 00:00:00', '2026-01-01 00:00:00', 'success', 'accepted', 3, 'native',"
            " 'h', '{}', '{}', 0)"))
    await migrate.upgrade(engine)
    async with engine.connect() as conn:
        assert await conn.scalar(sa.text("SELECT trace_id FROM traces")) == "kept"


async def test_the_search_text_is_filled_for_stored_and_new_traces(engine: Any) -> None:
    """0010 fills trace_search for the traces already stored, its trigger for every new
    one (task and last final answer, lowercased), and deleting a trace takes its text."""
    from app.db.dialect import dialect_of, search_matches

    def insert(conn: Any, trace_id: str, trace: dict[str, Any]) -> Any:
        return conn.execute(sa.text(
            "INSERT INTO traces (trace_id, created_at, updated_at, status, stage, total_tokens,"
            " source_format, content_hash, original, trace, attempts) VALUES (:id, "
            "'2026-01-01 00:00:00', '2026-01-01 00:00:00', 'success', 'accepted', 3, 'native',"
            " 'h', '{}', :trace, 0)"), {"id": trace_id, "trace": json.dumps(trace)})

    await migrate.upgrade(engine, "0005")
    async with engine.begin() as conn:
        await insert(conn, "old", {"task": "Count LINES", "steps": [
            {"type": "final", "content": "Twelve"}]})
    await migrate.upgrade(engine)
    async with engine.begin() as conn:
        await insert(conn, "new", {"task": "Find the Capital", "steps": [
            {"type": "final", "content": "first try"}, {"type": "thought", "content": "hm"},
            {"type": "final", "content": "It is Paris"}]})
        await insert(conn, "empty", {"steps": []})

    async def found(words: str) -> list[str]:
        async with engine.connect() as conn:
            query = search_matches(dialect_of(conn), words)
            return sorted((await conn.execute(query)).scalars())

    async with engine.connect() as conn:
        texts = dict((await conn.execute(sa.text("SELECT trace_id, text FROM trace_search"))).all())
    assert texts == {"old": "count lines\ntwelve", "new": "find the capital\nit is paris",
                     "empty": "\n"}
    assert await found("lines") == ["old"]
    assert await found("paris") == ["new"] and await found("first try") == []
    async with engine.begin() as conn:
        await conn.execute(sa.text("DELETE FROM traces WHERE trace_id = 'old'"))
    assert await found("lines") == []
    async with engine.begin() as conn:  # the same id stored again gets its text again
        await insert(conn, "old", {"task": "Lines again", "steps": []})
    assert await found("lines") == ["old"]
