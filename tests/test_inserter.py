"""The group commit (app/ingest/inserter.py) on both databases: a row the database
refuses sinks alone, whichever place it has in the batch; rows go in as prepared, their
timestamps as SQLAlchemy's own statements write them."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.dialects import sqlite

from app.config import EnvironmentConfig, LimitsConfig, TraceServerConfig
from app.db import migrate, search
from app.db.engine import create_engine
from app.db.models import PAYLOADS, TRACE_SEARCH, TRACES, WITH_PAYLOADS
from app.db.types import EncodedJSON, UtcTimeStamp, utc_text
from app.errors import Conflict, Invalid
from app.evaluation.environment import Environment
from app.ingest.ingestor import Preparer
from app.ingest.inserter import INSERT, PreparedTrace, Stored, TraceInserter, insert_traces
from tests.support.builders import native_trace

PREPARER = Preparer(Environment.from_config(EnvironmentConfig()), LimitsConfig())


async def test_a_refused_row_sinks_alone_in_its_group_commit(
    trace_server: dict[str, Any],
) -> None:
    """On PostgreSQL a refused first insert aborted the transaction, and 17 of 32 good
    traces sent beside it got 422. Refused first, in the middle and last."""
    engine = create_engine(TraceServerConfig(**trace_server))
    await migrate.upgrade(engine)
    inserter = TraceInserter(engine)
    inserter.start()
    try:
        good = [PreparedTrace.of(PREPARER.row(native_trace(trace_id=f"good-{i}")))
                for i in range(32)]
        # A NOT NULL column left empty: refused by both databases.
        bad = [PreparedTrace.of(PREPARER.row(native_trace(trace_id=f"bad-{i}")) | {"status": None})
               for i in range(3)]
        rows = [bad[0], *good[:16], bad[1], *good[16:], bad[2]]
        # Submitted without yielding to the writer: one batch, one transaction.
        waiting = [inserter.submit(row) for row in rows]
        results = await asyncio.gather(*waiting, return_exceptions=True)
        answers = dict(zip([row.trace_id for row in rows], results, strict=True))
        for i in range(3):
            refused = answers[f"bad-{i}"]
            assert isinstance(refused, Invalid) and refused.status == 422, refused
        for i in range(32):
            stored = answers[f"good-{i}"]
            assert isinstance(stored, Stored) and not stored.duplicate, stored
        async with engine.connect() as conn:
            count = await conn.scalar(sa.text("SELECT count(*) FROM traces"))
        assert count == 32
    finally:
        await inserter.stop()
        await engine.dispose()


async def test_rows_read_back_as_prepared_and_sqlite_keeps_the_seed_timestamp_text(
    trace_server: dict[str, Any],
) -> None:
    """Rows go in without SQLAlchemy's type processing (dialect.BulkInsert): what is read
    back through SQLAlchemy is what was prepared, NULLs and JSON included, and SQLite's
    created_at is the text that `created_at < datetime('now', '-30 days')` compares."""
    engine = create_engine(TraceServerConfig(**trace_server))
    await migrate.upgrade(engine)
    inserter = TraceInserter(engine)
    inserter.start()
    try:
        rejected = native_trace(trace_id="rejected", steps=[
            {"type": "thought", "content": "same"}, {"type": "thought", "content": "same"},
            {"type": "thought", "content": "same"}])
        rows = {
            "plain": PREPARER.row(native_trace(trace_id="plain")),
            "rejected": PREPARER.row(rejected),
        }
        for row in rows.values():
            await inserter.insert(PreparedTrace.of(row))
        async with engine.connect() as conn:
            read = {r.trace_id: r._mapping for r in await conn.execute(
                sa.select(TRACES, PAYLOADS.c.original, PAYLOADS.c.trace, PAYLOADS.c.compressed)
                .select_from(WITH_PAYLOADS))}
            texts = {r.trace_id: tuple(r)[1:] for r in await conn.execute(sa.select(
                TRACE_SEARCH.c.trace_id, TRACE_SEARCH.c.text, TRACE_SEARCH.c.task,
                TRACE_SEARCH.c.final_answer))}
            ages: dict[str, Any] = dict((await conn.execute(sa.text(
                "SELECT trace_id, created_at FROM traces WHERE created_at < "
                + ("datetime('now', '+1 minute')" if engine.dialect.name == "sqlite"
                   else "now() + interval '1 minute'")))).all())
        for trace_id, row in rows.items():
            stored = read[trace_id]
            assert texts[trace_id] == row.pop("search_text")  # written with the trace
            # A preparer without an entry stage.
            assert row.pop("skip_kind") is None and row.pop("compressed_by") is None
            for column, value in row.items():
                if isinstance(value, EncodedJSON):
                    value = orjson.loads(value.text)
                assert stored[column] == value, column
            if engine.dialect.name == "sqlite":
                assert ages[trace_id] == row["created_at"].strftime("%Y-%m-%d %H:%M:%S.%f")
        assert read["rejected"]["reject_reasons"] and read["plain"]["reject_reasons"] == []
        assert read["plain"]["compressed_tokens"] is None
    finally:
        await inserter.stop()
        await engine.dispose()


async def test_resends_in_and_across_batches(trace_server: dict[str, Any]) -> None:
    """The first of a trace_id is stored; the same content again is its duplicate, other
    content a conflict, whether in the same group commit or a later one."""
    engine = create_engine(TraceServerConfig(**trace_server))
    await migrate.upgrade(engine)
    inserter = TraceInserter(engine)
    inserter.start()
    try:
        one = PreparedTrace.of(PREPARER.row(native_trace(trace_id="one")))
        other = PreparedTrace.of(PREPARER.row(native_trace(trace_id="one", task="another task")))
        together = await asyncio.gather(
            inserter.submit(one), inserter.submit(one), inserter.submit(other),
            return_exceptions=True)
        later = await asyncio.gather(
            inserter.submit(one), inserter.submit(other), return_exceptions=True)
        for answers in (together[1:], later):
            duplicate, conflict = answers
            assert isinstance(duplicate, Stored) and duplicate.duplicate
            assert duplicate.to_json() == {**one.stored.to_json(), "duplicate": True}
            assert isinstance(conflict, Conflict)
        assert together[0] == one.stored
    finally:
        await inserter.stop()
        await engine.dispose()


async def test_a_search_text_written_again_replaces_the_stored_one(
    trace_server: dict[str, Any],
) -> None:
    """A trajectory assembled again (OTLP) gets its new text, in the statement that
    stores the texts of others."""
    engine = create_engine(TraceServerConfig(**trace_server))
    await migrate.upgrade(engine)
    try:
        rows = [PreparedTrace.of(PREPARER.row(native_trace(trace_id=tid))) for tid in ("a", "b")]
        async with engine.begin() as conn:
            await conn.run_sync(insert_traces, rows)
            await conn.execute(sa.delete(TRACE_SEARCH).where(TRACE_SEARCH.c.trace_id == "b"))
        async with engine.begin() as conn:
            await conn.run_sync(search.index, [
                ("a", search.SearchText("written again", "Written again", None)),
                ("b", search.SearchText("new", "New", "Done"))])
        async with engine.connect() as conn:
            texts = {r.trace_id: tuple(r)[1:] for r in await conn.execute(sa.select(
                TRACE_SEARCH.c.trace_id, TRACE_SEARCH.c.text, TRACE_SEARCH.c.task,
                TRACE_SEARCH.c.final_answer))}
        assert texts == {"a": ("written again", "Written again", None),
                         "b": ("new", "New", "Done")}
    finally:
        await engine.dispose()


def test_values_and_rows_convert_both_ways() -> None:
    """What SQLAlchemy's statements take (the OTLP assembly replaces trajectories with
    them) and what the bulk insert takes are one row in two forms."""
    row = PREPARER.row(native_trace(trace_id="both"))
    values = INSERT.values(row)
    back = INSERT.row(values)
    assert back["created_at"] == row["created_at"] and back["trace_id"] == "both"
    assert INSERT.values(back) == values


def test_timestamps_are_written_as_sqlalchemy_writes_them_on_sqlite() -> None:
    """The bulk insert's text for a UtcTimeStamp is the text SQLAlchemy's own statements
    write, so that both sort and compare alike; years before 1000 included."""
    dialect = sqlite.dialect()
    written = sa.DateTime().dialect_impl(dialect).bind_processor(dialect)
    assert written is not None
    for moment in (datetime(2026, 12, 1, 23, 5, 1, tzinfo=UTC), datetime(999, 1, 2, 3, 4, 5, 6),
                   datetime(2026, 6, 1, 12, 0, 0, 123456, tzinfo=timezone(timedelta(hours=2)))):
        assert utc_text(moment) == written(UtcTimeStamp().process_bind_param(moment, dialect))
