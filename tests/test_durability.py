"""Nothing acknowledged is ever lost: restarts, SIGTERM with requests in flight, kill -9
(hub processes: what is under test is the process's own end)."""

from __future__ import annotations

import signal
import sqlite3
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.builders import native_trace
from tests.support.hubs import write_config
from tests.support.processes import HubProcess
from tests.support.waiting import wait_until


@pytest.mark.process
def test_traces_survive_a_restart(start_hub_process: Any, trace_server: dict[str, Any]) -> None:
    hub = start_hub_process(trace_server)
    with hub.client() as client:
        for i in range(5):
            assert client.post("/v1/traces", json=native_trace(trace_id=f"r-{i}")).status_code == 202
    assert hub.stop(signal.SIGTERM) == 0
    hub.start()
    with hub.client() as client:
        assert client.get("/v1/stats").json()["traces"] == 5
        assert client.get("/v1/traces/r-3").json()["trace"]["task"] == native_trace()["task"]


@pytest.mark.process
def test_sigterm_finishes_requests_in_flight(
    start_hub_process: Any, trace_server: dict[str, Any]
) -> None:
    hub = start_hub_process(trace_server)
    acknowledged: list[str] = []
    stop = threading.Event()

    def sender(n: int) -> None:
        with hub.client() as client:
            i = 0
            while not stop.is_set():
                try:
                    r = client.post("/v1/traces", json=native_trace(trace_id=f"f-{n}-{i}"))
                except httpx.TransportError:
                    return
                if r.status_code == 202:
                    acknowledged.append(r.json()["trace_id"])
                i += 1

    threads = [threading.Thread(target=sender, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: len(acknowledged) >= 40, 60, what="40 traces acknowledged", poll=0.01)
    assert hub.stop(signal.SIGTERM) == 0
    stop.set()
    for t in threads:
        t.join()
    assert "Trace server listening" in hub.log
    hub.start()
    with hub.client() as client:
        for trace_id in acknowledged:
            assert client.get(f"/v1/traces/{trace_id}").status_code == 200, trace_id


@pytest.mark.process
def test_kill_9_loses_no_acknowledged_trace(
    start_hub_process: Any, trace_server: dict[str, Any]
) -> None:
    hub: HubProcess = start_hub_process(trace_server)
    acknowledged: list[str] = []
    lock = threading.Lock()

    def sender(n: int) -> None:
        with hub.client() as client:
            for i in range(10_000):
                try:
                    r = client.post("/v1/traces", json=native_trace(trace_id=f"k-{n}-{i}"))
                except httpx.TransportError:
                    return  # the server died mid-request: not acknowledged
                assert r.status_code == 202
                with lock:
                    acknowledged.append(r.json()["trace_id"])

    threads = [threading.Thread(target=sender, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    wait_until(lambda: len(acknowledged) >= 200, 60, what="200 traces acknowledged", poll=0.005)
    hub.kill()
    for t in threads:
        t.join()
    hub.start()
    with hub.client() as client:
        stored = client.get("/v1/stats").json()["traces"]
        assert stored >= len(acknowledged)
        missing = [t for t in acknowledged if client.get(f"/v1/traces/{t}").status_code != 200]
    assert missing == []


def test_seed_sqlite_commands_run_against_the_file(
    start_hub: Any, tmp_path: Path
) -> None:
    db = tmp_path / "seed.db"
    hub = start_hub({"db_path": str(db)})
    with hub.client() as client:
        client.post("/v1/traces", json=native_trace(trace_id="old"))
        client.post("/v1/traces", json=native_trace(trace_id="new"))
    with sqlite3.connect(db) as conn:
        # Age one trace past the retention window, then run the seed's two commands.
        conn.execute("UPDATE traces SET created_at = datetime('now', '-40 days'), reward = 1 "
                     "WHERE trace_id = 'old'")
        latest = conn.execute(
            "SELECT trace_id, total_tokens, compressed_tokens, reward, status FROM traces "
            "ORDER BY created_at DESC LIMIT 1;"
        ).fetchone()
        assert latest[0] == "new" and latest[1] > 0 and latest[4] == "success"
        deleted = conn.execute(
            "DELETE FROM traces WHERE created_at < datetime('now', '-30 days') AND reward < 5;"
        ).rowcount
        assert deleted == 1
        assert [r[0] for r in conn.execute("SELECT trace_id FROM traces")] == ["new"]
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@pytest.mark.process
def test_serve_logs_its_two_lines_and_stops_cleanly_on_sigint(
    tmp_path: Path, trace_server: dict[str, Any]
) -> None:
    hub = HubProcess(write_config(tmp_path, trace_server)).start()
    hub.wait_for_log("Compression pipeline ready")
    assert hub.stop(signal.SIGINT) == 0
    assert "Traceback" not in hub.log


@pytest.mark.process
def test_no_workers_runs_the_api_alone(tmp_path: Path, trace_server: dict[str, Any]) -> None:
    hub = HubProcess(write_config(tmp_path, trace_server), "--no-workers").start()
    with hub.client() as client:
        assert client.post("/v1/traces", json=native_trace()).status_code == 202
    assert "Compression pipeline ready" not in hub.log
    hub.stop()
