"""Many hubs and workers on one PostgreSQL: two `atropos serve --no-workers` replicas
take thousands of traces at once while three `atropos worker` processes run the
stages; one worker is killed -9 midway. Every trace is stored once, scored, compressed
at most once, and delivered in exactly one batch."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.support.builders import native_trace
from tests.support.databases import (
    PG_ADMIN_URL,
    create_pg_database,
    db_execute,
    drop_pg_database,
)
from tests.support.processes import HubProcess, WorkerProcess
from tests.support.waiting import wait_until

TRACES = 3_000
BATCH = 25

pytestmark = [
    pytest.mark.process,
    pytest.mark.soak,
    pytest.mark.skipif(not PG_ADMIN_URL, reason="needs PostgreSQL"),
]


@pytest.fixture
def pg_server(tmp_path: Path) -> Any:
    url = create_pg_database()
    yield {"storage_backend": "postgresql", "database_url": url}
    drop_pg_database(url)


def post_all(hub: HubProcess, ids: list[str], acked: list[str], lock: threading.Lock) -> None:
    with hub.client() as client:
        for start in range(0, len(ids), 50):
            chunk = [native_trace(trace_id=t, task=f"task {t}") for t in ids[start:start + 50]]
            results = client.post("/v1/traces", json={"traces": chunk}).json()["results"]
            with lock:
                acked += [r["trace_id"] for r in results if "trace_id" in r]


def test_two_hubs_three_workers_one_killed(tmp_path: Path, pg_server: dict[str, Any]) -> None:
    out = tmp_path / "batches"
    sections = {
        "environment": {"invalid_trace_filters": []},
        "distributor": {"target": "jsonl", "output_dir": str(out), "batch_size": BATCH,
                        "min_reward_threshold": -1000},
        "workers": {"lease_seconds": 2},
        "trace_server": {"host": "127.0.0.1", "port": 0, "flush_interval_seconds": 1,
                         **pg_server},
    }
    config = tmp_path / "config.json"
    config.write_text(json.dumps(sections))
    hubs = [HubProcess(config, "--no-workers").start() for _ in range(2)]
    workers = [WorkerProcess(config).start() for _ in range(3)]
    try:
        ids = [f"s-{n:05d}" for n in range(TRACES)]
        acked: list[str] = []
        lock = threading.Lock()
        senders = [threading.Thread(target=post_all, args=(hubs[n % 2], ids[n::4], acked, lock))
                   for n in range(4)]
        for t in senders:
            t.start()
        wait_until(lambda: len(acked) >= TRACES // 3, 180, what="a third of the traces acked")
        workers[0].kill()  # mid-ingest and mid-stage
        for t in senders:
            t.join()
        assert sorted(acked) == ids

        def delivered() -> int:
            [row] = db_execute(pg_server, "SELECT count(*) AS n FROM traces WHERE stage = 'delivered'")
            return int(row["n"])

        wait_until(lambda: delivered() == TRACES, 180, what=f"all {TRACES} delivered", poll=0.5)
    finally:
        for process in [*hubs, *workers]:
            process.kill()

    [row] = db_execute(pg_server, "SELECT count(*) AS n, count(DISTINCT trace_id) AS d, "
                                  "count(reward) AS scored FROM traces")
    assert row == {"n": TRACES, "d": TRACES, "scored": TRACES}
    # Each trace is in exactly one batch, each batch exactly BATCH traces, all delivered.
    members = db_execute(pg_server, "SELECT batch_id, count(*) AS n FROM batch_traces "
                                    "GROUP BY batch_id")
    assert len(members) == TRACES // BATCH and {m["n"] for m in members} == {BATCH}
    [row] = db_execute(pg_server, "SELECT count(*) AS n FROM batches WHERE state <> 'delivered'")
    assert row["n"] == 0
    # The training files agree: every trace once, across all batch files.
    records = [json.loads(line) for f in out.glob("*.jsonl") if f.name != "manifest.jsonl"
               for line in f.read_text().splitlines()]
    assert len(records) == TRACES
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert len(manifest) == TRACES // BATCH
    # Compressed at most once: one compression record per trace, none left leased.
    [row] = db_execute(pg_server, "SELECT count(*) AS n FROM traces WHERE compression IS NULL "
                                  "OR lease_owner IS NOT NULL")
    assert row["n"] == 0
