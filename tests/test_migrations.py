"""Alembic owns the schema: every revision goes up and down on both databases, and an
upgrade never loses rows."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from app.atropos.segments import Segment, plain_join
from app.config import TraceServerConfig
from app.db import migrate
from app.db.engine import create_engine
from app.db.models import Base


def revisions() -> list[str]:
    script = ScriptDirectory.from_config(migrate._alembic_config())
    return [rev.revision for rev in reversed(list(script.walk_revisions()))]


def test_the_head_read_from_the_revision_files_is_alembics() -> None:
    """Start-up compares the database with the head read from the files (alembic is
    not imported when there is nothing to migrate): the same head alembic finds."""
    script = ScriptDirectory.from_config(migrate._alembic_config())
    assert migrate.head_revision() == ",".join(sorted(script.get_heads()))


@pytest.fixture
async def engine(empty_trace_server: dict[str, Any]) -> Any:
    engine = create_engine(TraceServerConfig(**empty_trace_server))
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
    """A row with the columns every revision has (reward 20), and its payloads (in
    their own table from 0025 on)."""
    apart = "trace_payloads" in await tables(engine)
    names, values = ("", "") if apart else ("original, trace, ", "'{}', '{}', ")
    async with engine.begin() as conn:
        await conn.execute(sa.text(
            "INSERT INTO traces (trace_id, created_at, updated_at, status, stage, total_tokens,"
            f" reward, source_format, content_hash, {names}attempts) VALUES (:id, "
            "'2026-01-01 00:00:00', '2026-01-01 00:00:00', 'success', 'accepted', 3, 20,"
            f" 'native', 'h', {values}0)"), {"id": trace_id})
        if apart:
            await conn.execute(sa.text("INSERT INTO trace_payloads (trace_id, original, trace) "
                                       "VALUES (:id, '{}', '{}')"), {"id": trace_id})


@pytest.mark.parametrize("start", revisions())
async def test_upgrade_from_every_revision_keeps_the_rows(engine: Any, start: str) -> None:
    await migrate.upgrade(engine, start)
    await insert_trace(engine, "kept")
    await migrate.upgrade(engine)
    async with engine.connect() as conn:
        assert await conn.scalar(sa.text("SELECT trace_id FROM traces")) == "kept"


async def test_the_otlp_tables_come_with_0012_and_match_their_models(engine: Any) -> None:
    assert revisions()[revisions().index("0011") + 1] == "0012"
    await migrate.upgrade(engine, "0011")
    assert not {"otlp_spans", "otlp_traces"} & await tables(engine)
    await migrate.upgrade(engine, "0012")
    assert {"otlp_spans", "otlp_traces"} <= await tables(engine)
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
    assert "0006" in revisions()
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


async def test_0008_deflates_atropos_groups_and_back(engine: Any) -> None:
    """Groups queued before 0008 are served after it, byte for byte, and after a
    downgrade again; envs registered before it count as last heard at registration."""
    payload = '{"tokens":[[1,2,3]],"masks":[[-100,2,3]],"scores":[1.0]}' * 50
    await migrate.upgrade(engine, "0005")
    async with engine.begin() as conn:
        await conn.execute(sa.text(
            "INSERT INTO atropos_envs (env_id, desired_name, real_name, weight,"
            " max_token_length, group_size, connected, registered_at) VALUES"
            " (0, 'e', 'e_0', 1.0, 512, 1, true, '2026-01-01 00:00:00')"))
        await conn.execute(sa.text("INSERT INTO atropos_payloads (id, payload) VALUES (7, :p)"),
                           {"p": payload})
        await conn.execute(sa.text(
            "INSERT INTO atropos_groups (id, state, env_id, size, bytes, fill_logprobs,"
            " payload_id, created_at) VALUES (3, 'queued', 0, 1, :n, true, 7,"
            " '2026-01-01 00:00:00')"), {"n": len(payload)})
    await migrate.upgrade(engine)
    async with engine.connect() as conn:
        row = (await conn.execute(sa.text(
            "SELECT s.deflated, s.crc32, g.bytes FROM atropos_groups g"
            " JOIN atropos_segments s ON s.id = g.segment_id WHERE g.id = 3"))).one()
        seen = await conn.scalar(sa.text("SELECT last_seen_at FROM atropos_envs"))
    assert plain_join([Segment(bytes(row[0]), row[1], row[2])]).decode() == payload
    assert len(row[0]) < len(payload) / 4
    assert str(seen).startswith("2026-01-01 00:00:00")
    await migrate.downgrade(engine, "0005")
    async with engine.connect() as conn:
        assert await conn.scalar(sa.text(
            "SELECT p.payload FROM atropos_groups g"
            " JOIN atropos_payloads p ON p.id = g.payload_id WHERE g.id = 3")) == payload

async def test_the_search_text_is_filled_for_stored_and_new_traces(engine: Any) -> None:
    """0010 fills trace_search for the traces already stored, its trigger for every new
    one (task and last final answer, lowercased), and deleting a trace takes its text.
    0013 drops the trigger (the hub writes the text: tests/test_reviews.py) and keeps
    the texts; down from it, the trigger is back."""
    from app.db.search import matching

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
    await migrate.upgrade(engine, "0012")
    async with engine.begin() as conn:
        await insert(conn, "new", {"task": "Find the Capital", "steps": [
            {"type": "final", "content": "first try"}, {"type": "thought", "content": "hm"},
            {"type": "final", "content": "It is Paris"}]})
        await insert(conn, "empty", {"steps": []})

    async def found(words: str) -> list[str]:
        async with engine.connect() as conn:
            query = matching(words)
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

    await migrate.upgrade(engine, "0024")  # the last with the payloads in `traces`
    async with engine.begin() as conn:
        await insert(conn, "by hand", {"task": "Lines by hand", "steps": []})
    assert await found("lines") == ["old"] and await found("paris") == ["new"]
    await migrate.downgrade(engine, "0012")
    async with engine.begin() as conn:
        await insert(conn, "by hand again", {"task": "Lines by hand", "steps": []})
    assert await found("by hand") == ["by hand again"]


async def test_0023_fills_the_task_and_final_answer_the_list_shows(engine: Any) -> None:
    """Traces stored before 0023 get their task and last final answer as written (the
    trace list shows them), every search row kept; down again, the texts stay."""
    await migrate.upgrade(engine, "0022")
    async with engine.begin() as conn:
        traces: dict[str, dict[str, Any]] = {
            "answered": {"task": "Find the Capital", "steps": [
                {"type": "final", "content": "First try"},
                {"type": "final", "content": "It is Paris"}]},
            "unanswered": {"task": "Count LINES", "steps": [{"type": "thought", "content": "hm"}]},
        }
        for trace_id, trace in traces.items():
            await conn.execute(sa.text(
                "INSERT INTO traces (trace_id, created_at, updated_at, status, stage, "
                "total_tokens, source_format, content_hash, original, trace, attempts) VALUES "
                "(:id, '2026-01-01 00:00:00', '2026-01-01 00:00:00', 'success', 'accepted', 3, "
                "'native', 'h', '{}', :trace, 0)"), {"id": trace_id, "trace": json.dumps(trace)})
            await conn.execute(sa.text(
                "INSERT INTO trace_search (trace_id, text) VALUES (:id, :text)"),
                {"id": trace_id, "text": trace["task"].lower()})
    await migrate.upgrade(engine)
    async with engine.connect() as conn:
        rows = {r.trace_id: tuple(r)[1:] for r in await conn.execute(sa.text(
            "SELECT trace_id, text, task, final_answer FROM trace_search"))}
    assert rows == {"answered": ("find the capital", "Find the Capital", "It is Paris"),
                    "unanswered": ("count lines", "Count LINES", None)}
    await migrate.downgrade(engine, "0022")
    async with engine.connect() as conn:
        kept = dict((await conn.execute(sa.text("SELECT trace_id, text FROM trace_search"))).all())
    assert kept == {"answered": "find the capital", "unanswered": "count lines"}


async def test_postgresql_compresses_the_large_trace_values_with_lz4(engine: Any) -> None:
    """0014: a trace's large JSON is TOASTed with lz4 (faster than pglz, the default), a
    value stored before it reads back as stored, and down from it pglz is back."""
    if engine.dialect.name != "postgresql":
        pytest.skip("SQLite compresses nothing")
    big = {"task": "x" * 3000, "steps": [{"type": "final", "content": "y" * 3000}]}

    async def store(trace_id: str) -> None:
        async with engine.begin() as conn:
            await conn.execute(sa.text(
                "INSERT INTO traces (trace_id, created_at, updated_at, status, stage,"
                " total_tokens, source_format, content_hash, original, trace, attempts)"
                " VALUES (:id, now(), now(), 'success', 'accepted', 3, 'native', 'h',"
                " :trace, :trace, 0)"), {"id": trace_id, "trace": json.dumps(big)})

    async def compressed_with() -> dict[str, str]:
        async with engine.connect() as conn:
            rows = (await conn.execute(sa.text(
                "SELECT trace_id, pg_column_compression(trace), trace FROM traces"))).all()
        assert all(trace == big for _, _, trace in rows)  # each reads back as stored
        return {trace_id: method for trace_id, method, _ in rows}

    await migrate.upgrade(engine, "0013")
    await store("before")
    await migrate.upgrade(engine, "0024")  # from 0025 on, the payloads have a table
    await store("after")
    assert await compressed_with() == {"before": "pglz", "after": "lz4"}
    await migrate.downgrade(engine, "0013")
    await store("down again")
    assert (await compressed_with())["down again"] == "pglz"


async def test_0025_moves_the_payloads_to_their_table_and_back_keeping_every_row(
    engine: Any,
) -> None:
    """The payloads of the traces stored before 0025 are in trace_payloads after it (a
    compressed one with its compressed trace), the rows that refer to a trace are kept
    (no copy of `traces` cascades into them), and down again the columns hold them."""
    payloads = {
        "plain": ({"task": "as sent"}, {"task": "t", "steps": []}, None),
        "compressed": ([1, "x" * 3000], {"task": "u" * 3000, "steps": []}, {"task": "u"}),
    }
    await migrate.upgrade(engine, "0024")
    async with engine.begin() as conn:
        for trace_id, (original, trace, compressed) in payloads.items():
            await conn.execute(sa.text(
                "INSERT INTO traces (trace_id, created_at, updated_at, status, stage, "
                "total_tokens, source_format, content_hash, original, trace, compressed, "
                "attempts) VALUES (:id, '2026-01-01 00:00:00', '2026-01-01 00:00:00', "
                "'success', 'accepted', 3, 'native', 'h', :original, :trace, :compressed, 0)"),
                {"id": trace_id, "original": json.dumps(original), "trace": json.dumps(trace),
                 "compressed": None if compressed is None else json.dumps(compressed)})
            await conn.execute(sa.text(
                "INSERT INTO trace_search (trace_id, text) VALUES (:id, 't')"), {"id": trace_id})
        await conn.execute(sa.text(
            "INSERT INTO reviews (trace_id, label, reviewer, reviewed_at) "
            "VALUES ('plain', 'good', 'me', '2026-01-01 00:00:00')"))

    async def read(table: str) -> dict[str, tuple[Any, ...]]:
        async with engine.connect() as conn:
            rows = (await conn.execute(sa.text(
                f"SELECT trace_id, original, trace, compressed FROM {table}"))).all()
        return {row[0]: tuple(json.loads(v) if isinstance(v, str) else v for v in row[1:])
                for row in rows}

    async def kept() -> tuple[int, int]:
        async with engine.connect() as conn:
            return (await conn.scalar(sa.text("SELECT count(*) FROM trace_search")),
                    await conn.scalar(sa.text("SELECT count(*) FROM reviews")))

    await migrate.upgrade(engine)
    assert await read("trace_payloads") == payloads
    assert not {"original", "trace", "compressed"} & set(await columns(engine, "traces"))
    assert await kept() == (2, 1)
    await migrate.downgrade(engine, "0024")
    assert "trace_payloads" not in await tables(engine)
    assert await read("traces") == payloads
    assert await kept() == (2, 1)
