"""The group commit (app/db/group_commit.py) on both databases, with a kind of its own:
an item withdrawn while its transaction runs (its deadline, its caller gone) is never
written and the others are; a stop writes and answers what is queued."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.config import TraceServerConfig
from app.db.dialect import OneHop
from app.db.engine import create_engine
from app.db.errors import database_outage
from app.db.group_commit import GroupCommit
from app.errors import HubError, Unavailable
from tests.support.waiting import wait_until_async


class _Notes:
    """Notes, each a row. Until `release()`, a transaction waits in its middle: on
    SQLite (the writer's own thread) for an event, on PostgreSQL (the event loop, whose
    timers run meanwhile) for a lock on the table that the test holds."""

    name = "notes"

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._released = threading.Event()
        self._lock: AsyncConnection | None = None
        self.writing = threading.Event()

    async def hold(self) -> None:
        if self._engine.dialect.name == "postgresql":
            self._lock = await self._engine.connect()
            await self._lock.begin()
            await self._lock.execute(sa.text("LOCK TABLE gc_notes IN EXCLUSIVE MODE"))

    async def release(self) -> None:
        self._released.set()
        if self._lock is not None:
            await self._lock.commit()
            await self._lock.close()

    def write(self, conn: sa.Connection, items: Sequence[str]) -> list[str | HubError]:
        self.writing.set()
        if conn.dialect.name == "sqlite":
            self._released.wait(30)
        conn.execute(sa.text("INSERT INTO gc_notes (note) VALUES (:note)"),
                     [{"note": note} for note in items])
        return [f"stored {note}" for note in items]


@asynccontextmanager
async def _notes_database(trace_server: dict[str, Any]) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(TraceServerConfig(**trace_server))
    async with engine.begin() as conn:
        await conn.execute(sa.text("CREATE TABLE gc_notes (note varchar(20) PRIMARY KEY)"))
    try:
        yield engine
    finally:
        await engine.dispose()


async def _stored(engine: AsyncEngine) -> set[str]:
    async with engine.connect() as conn:
        return set((await conn.scalars(sa.text("SELECT note FROM gc_notes"))).all())


async def test_an_item_withdrawn_mid_transaction_is_not_written_and_the_others_are(
    trace_server: dict[str, Any],
) -> None:
    async with _notes_database(trace_server) as engine:
        kind, writer = _Notes(engine), OneHop(engine)
        await kind.hold()
        commits: GroupCommit[str, str] = GroupCommit(kind, writer, database_outage())
        commits.start()
        try:
            gone, kept = commits.submit("gone"), commits.submit("kept")  # one transaction
            await wait_until_async(kind.writing.is_set, 30, what="the transaction to write")
            gone.cancel()  # its client went away before the commit
            await kind.release()
            assert await kept == "stored kept"
            assert await _stored(engine) == {"kept"}
        finally:
            await commits.stop()
            await writer.close()


async def test_past_its_deadline_an_item_is_503_and_never_written_later(
    trace_server: dict[str, Any],
) -> None:
    async with _notes_database(trace_server) as engine:
        kind, writer = _Notes(engine), OneHop(engine)
        await kind.hold()
        commits: GroupCommit[str, str] = GroupCommit(kind, writer, database_outage(),
                                                     max_wait=0.2, retry_after=3)
        commits.start()
        try:
            late = commits.submit("late")
            with pytest.raises(Unavailable) as answer:
                await late  # answered while its transaction still waits
            assert kind.writing.is_set()
            assert answer.value.retry_after == 3
            assert answer.value.field == "limits.max_write_wait_seconds"
            await kind.release()
            await commits.stop()  # the transaction has ended, rolled back
            assert await _stored(engine) == set()
            assert commits.failure is None  # withdrawn is not a failed write
        finally:
            await commits.stop()
            await writer.close()


async def test_a_stop_writes_and_answers_what_is_queued(trace_server: dict[str, Any]) -> None:
    async with _notes_database(trace_server) as engine:
        kind, writer = _Notes(engine), OneHop(engine)
        await kind.release()
        commits: GroupCommit[str, str] = GroupCommit(kind, writer, database_outage(),
                                                     max_items=2)
        commits.start()
        try:
            queued = [commits.submit(f"n{i}") for i in range(5)]  # three transactions
            await commits.stop()
            assert [f.result() for f in queued] == [f"stored n{i}" for i in range(5)]
            assert await _stored(engine) == {f"n{i}" for i in range(5)}
            with pytest.raises(Unavailable):
                commits.submit("after")
        finally:
            await writer.close()


class _Levels:
    """Notes that record the durability their transaction commits with."""

    name = "levels"

    def __init__(self) -> None:
        self.seen: list[str] = []

    def write(self, conn: sa.Connection, items: Sequence[str]) -> list[str | HubError]:
        asked = "PRAGMA synchronous" if conn.dialect.name == "sqlite" else "SHOW synchronous_commit"
        self.seen.append(str(conn.exec_driver_sql(asked).scalar()))
        conn.execute(sa.text("INSERT INTO gc_notes (note) VALUES (:note)"),
                     [{"note": note} for note in items])
        return list(items)


async def test_an_unsynced_kind_commits_unsynced_and_leaves_the_others_synced(
    trace_server: dict[str, Any],
) -> None:
    """The gateway's captures are answered before their commit reaches the disk; the
    traces sharing the writer keep commits that do (SQLite 1 = NORMAL, 2 = FULL)."""
    async with _notes_database(trace_server) as engine:
        if engine.dialect.name == "postgresql":  # the test cluster's default is off
            async with engine.begin() as conn:
                await conn.exec_driver_sql(f"ALTER DATABASE {engine.url.database} "
                                           "SET synchronous_commit = on")
            await engine.dispose()
        writer = OneHop(engine)
        unsynced, synced = _Levels(), _Levels()
        fast: GroupCommit[str, str] = GroupCommit(unsynced, writer, database_outage(),
                                                  synced=False)
        safe: GroupCommit[str, str] = GroupCommit(synced, writer, database_outage())
        fast.start()
        safe.start()
        try:
            for n in range(3):  # in turns on the one writer
                assert await fast.submit(f"fast{n}") == f"fast{n}"
                assert await safe.submit(f"safe{n}") == f"safe{n}"
            assert await _stored(engine) == {f"{k}{n}" for k in ("fast", "safe") for n in range(3)}
            if engine.dialect.name == "sqlite":
                assert (unsynced.seen, synced.seen) == (["1"] * 3, ["2"] * 3)
            else:
                assert (unsynced.seen, synced.seen) == (["off"] * 3, ["on"] * 3)
        finally:
            await fast.stop()
            await safe.stop()
            await writer.close()
            if engine.dialect.name == "postgresql":
                async with engine.begin() as conn:
                    await conn.exec_driver_sql(f"ALTER DATABASE {engine.url.database} "
                                               "RESET synchronous_commit")
