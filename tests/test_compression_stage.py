"""The compression stage in a running hub and in `atropos worker`, on real long traces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import ROOT, native_trace, write_config
from tests.real_traces import OPENHANDS, SWE_AGENT, load

DONE = {"compressed", "compression_skipped", "compression_failed"}
# Some real runs are rejected by the default filters (error streaks); these tests are
# about compression, so every trace is let through.
ACCEPT_ALL = {"invalid_trace_filters": []}
# The distribution stage moves traces on (below_threshold, batched); these tests look
# at compression, so no trace is ever below the threshold or in a full batch.
NO_BATCHES = {"min_reward_threshold": -1e9, "batch_size": 100_000}


def as_native(path: Path, trace_id: str) -> dict[str, Any]:
    body = load(path).model_dump(mode="json", exclude_none=True, exclude={"source_format"})
    return body | {"trace_id": trace_id, "format": "native"}


def compression_file(tmp_path: Path, **policy: Any) -> str:
    path = tmp_path / f"compression-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps({"compression": policy}))
    return str(path)


def wait_until_done(client: httpx.Client, trace_ids: list[str], timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    records: dict[str, Any] = {}
    while time.monotonic() < deadline:
        records = {t: client.get(f"/v1/traces/{t}").json() for t in trace_ids}
        if all(r["stage"] in DONE for r in records.values()):
            return records
        time.sleep(0.2)
    raise AssertionError({t: r["stage"] for t, r in records.items()})


def test_long_real_traces_are_compressed_and_short_ones_skipped(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    # The per-trace "compression skipped" line is DEBUG.
    hub = start_hub(trace_server, "--log-level", "debug", "--compression", compression_file(tmp_path),
                    environment=ACCEPT_ALL, distributor=NO_BATCHES)
    with hub.client() as client:
        long_ids = []
        for n, path in enumerate([*OPENHANDS, SWE_AGENT[3]]):
            r = client.post("/v1/traces", json=as_native(path, f"long-{n}"))
            assert r.status_code == 202, r.text
            long_ids.append(f"long-{n}")
        assert client.post("/v1/traces", json=native_trace(trace_id="short")).status_code == 202
        records = wait_until_done(client, [*long_ids, "short"])

        for trace_id in long_ids:
            record = records[trace_id]
            assert record["stage"] == "compressed", record
            info = record["compression"]
            assert info["strategy"] == "key_decision_extract"
            assert record["compressed_tokens"] == info["tokens_after"]
            assert record["total_tokens"] >= 3 * record["compressed_tokens"]
            assert 500 <= record["compressed_tokens"] <= 8000 or info["over_limit"]
            view = client.get(f"/v1/traces/{trace_id}", params={"view": "compressed"}).json()
            compressed = view["trace"]
            original = client.get(f"/v1/traces/{trace_id}").json()["trace"]
            assert compressed["metadata"]["sft_only"] is True
            assert compressed["task"] == original["task"]
            errors = [s for s in original["steps"] if s.get("error")]
            kept = [s for s in compressed["steps"] if s.get("error")]
            assert len(kept) == len(errors)

        assert records["short"]["stage"] == "compression_skipped"
        assert "min_tokens_after" in records["short"]["compression"]["skipped"]
        stats = client.get("/v1/stats").json()["compression"]
        assert stats["compressed"] == len(long_ids) and stats["skipped"] == 1
        assert 0 < stats["mean_ratio"] <= 1 / 3
    hub.wait_for_log("compression skipped: trace short")


def test_traces_over_max_tokens_are_compressed_even_when_disabled(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    policy = compression_file(tmp_path, enabled=False)
    hub = start_hub({**trace_server, "max_trace_tokens": 20_000}, "--compression", policy,
                    environment=ACCEPT_ALL, distributor=NO_BATCHES)
    with hub.client() as client:
        client.post("/v1/traces", json=as_native(OPENHANDS[0], "big"))
        client.post("/v1/traces", json=native_trace(trace_id="small"))
        records = wait_until_done(client, ["big", "small"])
    assert records["big"]["total_tokens"] > 20_000
    assert records["big"]["stage"] == "compressed"
    assert records["small"]["stage"] == "compression_skipped"
    assert "disabled" in records["small"]["compression"]["skipped"]


def test_kill_9_during_the_stage_compresses_every_trace_once(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    """An API without workers takes the traces; a worker is killed -9 mid-stage; a
    second worker (burst) finishes. Every trace ends compressed, none left leased."""
    hub = start_hub(trace_server, "--no-workers", workers={"lease_seconds": 1},
                    environment=ACCEPT_ALL, distributor=NO_BATCHES)
    ids = []
    with hub.client() as client:
        for n in range(40):
            path = [*OPENHANDS, *SWE_AGENT][n % 9]
            client.post("/v1/traces", json=as_native(path, f"k-{n}") | {"task": f"task {n}"})
            ids.append(f"k-{n}")
    config = write_config(tmp_path, trace_server, workers={"lease_seconds": 1},
                          distributor=NO_BATCHES)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "app.cli", "worker", "--config", str(config)]
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    with hub.client() as client:
        deadline = time.monotonic() + 60
        while client.get("/v1/stats").json()["compression"]["compressed"] < 5:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    first.kill()
    first.communicate()
    time.sleep(1.2)  # the dead worker's leases run out
    burst = subprocess.run([*cmd, "--burst"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
    assert burst.returncode == 0, burst.stderr
    with hub.client() as client:
        records = wait_until_done(client, ids, timeout=5)
    assert {r["stage"] for r in records.values()} <= {"compressed", "compression_skipped"}
    assert "lease lost" not in burst.stderr
