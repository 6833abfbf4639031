"""When the write path cannot keep up (another process holds the database's write lock),
the hub answers 503 with Retry-After at once, instead of queueing without bound or
letting requests time out; what it did admit is stored once the lock is gone."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx

from tests.support.builders import native_trace
from tests.support.databases import write_lock
from tests.support.hubs import InProcessHub
from tests.support.waiting import wait_until


def in_background(hub: InProcessHub) -> Callable[[Any], Future[httpx.Response]]:
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
            # Its own wait is bounded too: 503 once it has waited 0.5 s for its commit.
            overloaded(first.result(10), "max_write_wait_seconds", "3")
            started = time.monotonic()
            overloaded(client.post("/v1/traces", json=native_trace(trace_id="second")),
                       "max_write_wait_seconds", "3")
            overloaded(client.post("/v1/traces", json=[native_trace(trace_id="third")]),
                       "max_write_wait_seconds", "3")
            assert time.monotonic() - started < 2
            # Reading goes on meanwhile.
            assert client.get("/v1/stats").status_code == 200
        # The transaction that waited on the lock rolls back: "first" was withdrawn.
        wait_until(lambda: client.get("/readyz").status_code == 200, what="/readyz 200")
        assert client.post("/v1/traces", json=native_trace(trace_id="fourth")).status_code == 202
        for trace_id in ("first", "second"):  # answered 503: never written
            assert client.get(f"/v1/traces/{trace_id}").status_code == 404
        assert client.get("/v1/stats").json()["traces"] == 2


def test_no_request_waits_past_the_bound_and_readiness_follows_the_write_path(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    """With another process holding the write lock past SQLite's busy timeout (10 s), a
    write failed, the timer behind limits.max_write_wait_seconds restarted, and
    requests admitted then waited 15-38 s; /readyz said 200 throughout.
    Every request is answered within the bound (503, never written afterwards), /readyz
    says 503 while writes fail and 200 again by itself once they succeed."""
    hub = start_hub(trace_server, "--no-workers",
                    limits={"max_write_wait_seconds": 1, "retry_after_seconds": 3})
    post = in_background(hub)
    with hub.client() as client:
        assert client.post("/v1/traces", json=native_trace(trace_id="warm")).status_code == 202
        assert client.get("/readyz").status_code == 200
        sent: list[Future[httpx.Response]] = []
        reasons = set()
        with write_lock(trace_server):
            locked_until = time.monotonic() + 11
            n = 0
            while time.monotonic() < locked_until:
                sent.append(post(native_trace(trace_id=f"locked-{n}")))
                n += 1
                ready = client.get("/readyz")
                if ready.status_code == 503:
                    reasons.add(ready.json()["reason"].split(":")[0])
                time.sleep(0.5)  # a client sending twice a second
            for answer in sent:
                r = answer.result(10)
                assert r.status_code == 503 and r.headers["retry-after"] == "3", r.text
                # Answered within the bound (plus parsing and the round trip).
                assert r.elapsed.total_seconds() < 2.5, (r.elapsed, r.text)
        assert reasons == {"not taking writes"}
        # Nothing wrote since: /readyz finds out by itself that writes work again.
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=20,
                   what="/readyz back to 200")
        assert client.post("/v1/traces", json=native_trace(trace_id="after")).status_code == 202
        stored = {t["trace_id"] for t in client.get("/v1/traces").json()["traces"]}
    assert stored == {"warm", "after"}, "a request answered 503 was written later"


def test_queued_traces_are_bounded(start_hub: Any, trace_server: dict[str, Any]) -> None:
    hub = start_hub(trace_server, "--no-workers",
                    limits={"max_queued_traces": 4, "max_traces_per_request": 4,
                            "max_write_wait_seconds": 60})
    post = in_background(hub)

    def admitted() -> int:
        """Traces holding a place on the write path (the hub's own count)."""
        return int(hub.internals.ingestor._admission.pending)

    with hub.client() as client:
        assert client.post("/v1/traces", json=native_trace(trace_id="warm")).status_code == 202
        with write_lock(trace_server):
            batch = post([native_trace(trace_id=f"b-{i}") for i in range(3)])
            wait_until(lambda: admitted() == 3, what="the batch admitted")
            overloaded(client.post("/v1/traces", json=[native_trace(), native_trace()]),
                       "max_queued_traces", "2")
            single = post(native_trace(trace_id="fits"))  # 3 + 1: still admitted
            wait_until(lambda: admitted() == 4, what="the single trace admitted")
            overloaded(client.post("/v1/traces", json=native_trace(trace_id="over")),
                       "max_queued_traces", "2")
            assert not batch.done() and not single.done()
        assert [r["trace_id"] for r in batch.result(20).json()["results"]] == [
            "b-0", "b-1", "b-2"]
        assert single.result(20).status_code == 202
        assert client.get("/v1/stats").json()["traces"] == 5
        # The places are given back: a full batch fits again.
        assert client.post("/v1/traces", json=[native_trace()] * 4).status_code == 207


def test_a_lock_held_past_sqlites_busy_timeout_is_503_not_422(
    start_hub: Any, tmp_path: Any
) -> None:
    """SQLite gives up on a lock after its busy_timeout (10 s): the trace was answered
    422 "database is locked", and a client drops a trace on a 4xx."""
    trace_server = {"storage_backend": "sqlite", "db_path": str(tmp_path / "t.db")}
    hub = start_hub(trace_server, "--no-workers", limits={"max_write_wait_seconds": 60})
    post = in_background(hub)
    with hub.client() as client:
        assert client.post("/v1/traces", json=native_trace(trace_id="warm")).status_code == 202
        with write_lock(trace_server):
            single = post(native_trace(trace_id="single"))
            batch = post([native_trace(trace_id="a"), native_trace(trace_id="b")])
            r = single.result(40)
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
            results = batch.result(40).json()["results"]
            assert [item["error"]["code"] for item in results] == ["unavailable"] * 2
        # Sent again once the lock is gone, as a client told 503 does: stored.
        assert client.post("/v1/traces", json=native_trace(trace_id="single")).status_code == 202
        assert client.get("/v1/stats").json()["traces"] == 2
