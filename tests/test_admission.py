"""When the write path cannot keep up (another process holds the database's write lock),
the hub answers 503 with Retry-After at once, instead of queueing without bound or
letting requests time out; what it did admit is stored once the lock is gone."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import asyncpg
import httpx

from tests.conftest import HubProcess, native_trace


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


def in_background(hub: HubProcess) -> Callable[[Any], Future[httpx.Response]]:
    pool = ThreadPoolExecutor(4)

    def post(body: Any) -> httpx.Response:
        with hub.client() as client:
            return client.post("/v1/traces", json=body)

    return lambda body: pool.submit(post, body)


def overloaded(r: httpx.Response, limit: str, retry_after: str) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == retry_after
    assert r.json()["error"]["code"] == "overloaded"
    assert r.json()["error"]["field"] == f"limits.{limit}"


def test_a_stalled_write_turns_new_traces_away(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    hub = start_hub(trace_server, "--no-workers",
                    limits={"max_write_wait_seconds": 0.5, "retry_after_seconds": 3})
    post = in_background(hub)
    with hub.client() as client:
        # Warm up (the tokenizer loads on first use), so that `first` reaches the
        # writer well within the second below.
        assert client.post("/v1/traces", json=native_trace(trace_id="warm")).status_code == 202
        with write_lock(trace_server):
            first = post(native_trace(trace_id="first"))
            time.sleep(1.0)
            assert not first.done()
            started = time.monotonic()
            overloaded(client.post("/v1/traces", json=native_trace(trace_id="second")),
                       "max_write_wait_seconds", "3")
            overloaded(client.post("/v1/traces", json=[native_trace(trace_id="third")]),
                       "max_write_wait_seconds", "3")
            assert time.monotonic() - started < 2
            # Reading goes on meanwhile.
            assert client.get("/v1/stats").status_code == 200
        assert first.result(20).status_code == 202
        assert client.post("/v1/traces", json=native_trace(trace_id="fourth")).status_code == 202
        assert client.get("/v1/traces/second").status_code == 404
        assert client.get("/v1/stats").json()["traces"] == 3


def test_queued_traces_are_bounded(start_hub: Any, trace_server: dict[str, Any]) -> None:
    hub = start_hub(trace_server, "--no-workers",
                    limits={"max_queued_traces": 4, "max_traces_per_request": 4,
                            "max_write_wait_seconds": 60})
    post = in_background(hub)
    with hub.client() as client:
        assert client.post("/v1/traces", json=native_trace(trace_id="warm")).status_code == 202
        with write_lock(trace_server):
            batch = post([native_trace(trace_id=f"b-{i}") for i in range(3)])
            time.sleep(0.5)
            overloaded(client.post("/v1/traces", json=[native_trace(), native_trace()]),
                       "max_queued_traces", "2")
            single = post(native_trace(trace_id="fits"))  # 3 + 1: still admitted
            time.sleep(0.5)
            overloaded(client.post("/v1/traces", json=native_trace(trace_id="over")),
                       "max_queued_traces", "2")
            assert not batch.done() and not single.done()
        assert [r["trace_id"] for r in batch.result(20).json()["results"]] == [
            "b-0", "b-1", "b-2"]
        assert single.result(20).status_code == 202
        assert client.get("/v1/stats").json()["traces"] == 5
        # The places are given back: a full batch fits again.
        assert client.post("/v1/traces", json=[native_trace()] * 4).status_code == 207
