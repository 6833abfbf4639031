"""GET /metrics: the counters and histograms of a running hub replay the
traffic it saw, the gauges say what its database holds, the processes of one machine
share their counters (PROMETHEUS_MULTIPROC_DIR), and the Grafana dashboard in docs/
uses only metrics a hub exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import ROOT
from tests.support.builders import long_trace, native_trace
from tests.support.hubs import write_config
from tests.support.metrics import Samples, scrape, value
from tests.support.processes import HubProcess, WorkerProcess
from tests.support.waiting import wait_until


def compression_file(directory: Path) -> str:
    """The default policy (key_decision_extract) from a compression.json."""
    path = directory / "compression.json"
    path.write_text(json.dumps({"compression": {}}))
    return str(path)


ERROR_STREAK = [{"type": "action", "tool": "t", "arguments": {}},
                {"type": "observation", "content": "x", "error": "boom"}] * 3
OPENAI = {"format": "openai", "messages": [{"role": "user", "content": "Add 2 and 2."},
                                           {"role": "assistant", "content": "4"}]}


def group(size: int, env_id: int) -> dict[str, Any]:
    return {"tokens": [[1, 2, 3 + i] for i in range(size)],
            "masks": [[-100, 2, 3 + i] for i in range(size)],
            "scores": [float(i % 2) for i in range(size)], "env_id": env_id}


@pytest.mark.process
def test_the_metrics_of_a_running_hub_replay_its_traffic(
    start_hub_process: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    hub = start_hub_process({**trace_server, "flush_interval_seconds": 0.2},
                            "--compression", compression_file(tmp_path),
                            distributor={"batch_size": 2, "min_reward_threshold": -1e9})
    with hub.client() as client:
        for body in (long_trace("long-0"), long_trace("long-1"),
                     native_trace(trace_id="short"), OPENAI,
                     native_trace(trace_id="streak", steps=ERROR_STREAK),
                     long_trace("long-0")):  # a resend: a duplicate
            assert client.post("/v1/traces", json=body).status_code == 202
        assert client.post("/v1/traces", json={"steps": "no"}).status_code == 422
        assert client.get("/v1/traces/streak").json()["stage"] == "rejected"
        assert client.get("/no/such/route").status_code == 404
        [rejected_by] = client.get("/v1/traces/streak").json()["reject_reasons"]

        trainer = {"wandb_group": "g", "wandb_project": "p", "batch_size": 4,
                   "max_token_len": 64, "checkpoint_dir": "/tmp/c", "save_checkpoint_interval": 1,
                   "starting_step": 0, "num_steps": 10}
        assert client.post("/register", json=trainer).status_code == 200
        env = client.post("/register-env", json={"max_token_length": 64, "desired_name": "e",
                                                 "weight": 1.0, "group_size": 2}).json()
        client.get("/batch")  # starts the run: the env is registered with an id now
        env = client.post("/register-env", json={"max_token_length": 64, "desired_name": "e",
                                                 "weight": 1.0, "group_size": 2}).json()
        for size in (2, 1):  # one queued, one buffered
            assert client.post("/scored_data", json=group(size, env["env_id"])).status_code == 200

        # Four traces not rejected, two per batch: two deliveries, by the stages; and the
        # three rollouts the env sent, trajectories of tokens alone (no tokenizer here),
        # rejected beside the streak. An attempt is counted before its batch's
        # acknowledgement commits: wait for the stored state too.
        def settled() -> bool:
            samples = scrape(client)[1]
            return (value(samples, "atropos_delivery_attempt_seconds_count",
                          result="delivered") == 2
                    and value(samples, "atropos_batches", state="delivered") == 2
                    and value(samples, "atropos_traces", stage="rejected") == 1 + 3)
        wait_until(settled, timeout=60,
                   what="two deliveries acknowledged and the env's rollouts")
        types, samples = scrape(client)

    ingested = "atropos_traces_ingested_total"
    assert value(samples, ingested, format="native", outcome="accepted") == 3
    assert value(samples, ingested, format="openai", outcome="accepted") == 1
    assert value(samples, ingested, outcome="rejected") == 1
    assert value(samples, ingested, outcome="duplicate") == 1
    assert value(samples, ingested, outcome="refused") == 1
    assert value(samples, "atropos_rejections_total", filter=rejected_by["filter"]) == 1

    requests = "atropos_http_request_duration_seconds_count"
    assert value(samples, requests, method="POST", route="/v1/traces", status="202") == 6
    assert value(samples, requests, method="POST", route="/v1/traces", status="422") == 1
    assert value(samples, requests, method="GET", route="/v1/traces/{trace_id:path}") == 2
    assert value(samples, requests, route="unmatched", status="404") == 1
    assert value(samples, "atropos_http_request_duration_seconds_bucket", route="/v1/traces",
                 status="202", le="+Inf") == 6

    assert value(samples, "atropos_compressions_total", outcome="compressed") == 2
    assert value(samples, "atropos_compressions_total", outcome="skipped") == 2
    tokens_in = value(samples, "atropos_compression_input_tokens_total",
                      strategy="key_decision_extract")
    tokens_out = value(samples, "atropos_compression_output_tokens_total",
                       strategy="key_decision_extract")
    assert tokens_in > 3 * tokens_out > 0

    attempts = "atropos_delivery_attempt_seconds_count"
    assert value(samples, attempts, target="jsonl", result="delivered") == 2
    assert value(samples, attempts, result="failed") == 0
    assert value(samples, "atropos_batches", state="delivered") == 2
    assert value(samples, "atropos_traces", stage="delivered") == 4
    assert value(samples, "atropos_traces", stage="rejected") == 1 + 3
    assert value(samples, "atropos_trace_tokens_total") > tokens_in
    for stage in ("compression", "distribution", "delivery"):
        assert value(samples, "atropos_stage_backlog", stage=stage) == 0
        assert value(samples, "atropos_stage_oldest_item_age_seconds", stage=stage) == 0

    assert value(samples, "atropos_api_groups_received_total", placed="queued") == 1
    assert value(samples, "atropos_api_groups_received_total", placed="buffered") == 1
    assert value(samples, "atropos_api_queue_groups", state="queued") == 1
    assert value(samples, "atropos_api_queue_groups", state="buffered") == 1
    assert value(samples, "atropos_api_queue_bytes") > 0
    assert value(samples, "atropos_db_commit_seconds_count", writer="traces") >= 1
    assert value(samples, "atropos_db_commit_seconds_count", writer="atropos_groups") == 2
    assert types["atropos_ingest_process_restarts"] == "counter"  # counted in test_ingest_processes


def test_the_gauges_say_what_waits_for_each_stage_and_since_when(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    hub = start_hub(trace_server, "--no-workers",
                    distributor={"batch_size": 1, "min_reward_threshold": -1e9})
    with hub.client() as client:
        assert client.post("/v1/traces", json=native_trace(trace_id="waits")).status_code == 202
        samples = scrape(client)[1]
        assert value(samples, "atropos_traces", stage="compression_skipped") == 1
        assert value(samples, "atropos_stage_backlog", stage="distribution") == 1
        assert 0 <= value(samples, "atropos_stage_oldest_item_age_seconds",
                          stage="distribution") < 60
        assert value(samples, "atropos_trace_tokens_total") > 0

        hub.drain()
        samples = scrape(client)[1]
        assert value(samples, "atropos_traces", stage="delivered") == 1
        assert value(samples, "atropos_batches", state="delivered") == 1
        for stage in ("distribution", "delivery"):
            assert value(samples, "atropos_stage_backlog", stage=stage) == 0
            assert value(samples, "atropos_stage_oldest_item_age_seconds", stage=stage) == 0


@pytest.mark.process
def test_processes_sharing_a_multiproc_dir_serve_each_others_counters(tmp_path: Path) -> None:
    """`atropos serve --no-workers` and an `atropos worker`: the worker's compressions
    and deliveries are in the hub's /metrics."""
    shared = tmp_path / "prometheus"
    shared.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(shared)}
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db"),
                                     "flush_interval_seconds": 0.2},
                          distributor={"batch_size": 2, "min_reward_threshold": -1e9})
    hub = HubProcess(config, "--no-workers", env=env).start()
    worker = WorkerProcess(config, env=env).start()

    def delivered(samples: Samples) -> bool:
        return (value(samples, "atropos_delivery_attempt_seconds_count") == 1
                and value(samples, "atropos_traces", stage="delivered") == 2)

    try:
        with hub.client() as client:
            for n in range(2):
                assert client.post("/v1/traces", json=native_trace(trace_id=f"t-{n}")
                                   ).status_code == 202
            # The attempt is counted as it ends; the batch's move to delivered commits next.
            wait_until(lambda: delivered(scrape(client)[1]), timeout=60,
                       what="the worker's delivery in the hub's /metrics")
            _, samples = scrape(client)
    finally:
        worker.stop()
        hub.stop()
    assert value(samples, "atropos_traces_ingested_total", outcome="accepted") == 2  # the hub
    assert value(samples, "atropos_compressions_total", outcome="skipped") == 2  # the worker
    assert value(samples, "atropos_delivery_attempt_seconds_count", result="delivered") == 1
    assert value(samples, "atropos_traces", stage="delivered") == 2  # from the database


# Prometheus' own series suffixes: a histogram's, a counter's.
_SUFFIXES = {"_bucket": "histogram", "_count": "histogram", "_sum": "histogram",
             "_total": "counter"}


def test_every_metric_the_dashboard_uses_is_exported(client: httpx.Client) -> None:
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    used = {name for expr in exprs for name in re.findall(r"\batropos_\w+", expr)}
    assert len(used) >= 15
    types, _ = scrape(client)
    for name in sorted(used):
        if name in types:
            continue
        base, kind = next(((name.removesuffix(s), k) for s, k in _SUFFIXES.items()
                           if name.endswith(s)), (name, None))
        assert types.get(base) == kind, f"the dashboard queries {name}, which /metrics lacks"


@pytest.mark.process
def test_a_fresh_hub_has_a_series_for_every_metric_the_dashboard_queries(
    start_hub_process: Any, tmp_path: Path
) -> None:
    """No panel of the dashboard says "No data" on a hub that has done nothing yet: each
    metric it queries has its known label sets, at 0."""
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    used = {name for expr in exprs for name in re.findall(r"\batropos_\w+", expr)}
    hub = start_hub_process({"db_path": str(tmp_path / "t.db")})
    text = httpx.get(f"{hub.url}/metrics", timeout=30).text
    series = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
              if line and not line.startswith("#")}
    # Requests appear with the first request; this scrape is one.
    missing = sorted(name for name in used - series
                     if not name.startswith("atropos_http_request"))
    assert not missing, f"no series yet for {missing}"
    assert 'atropos_compressions_total{outcome="failed"} 0.0' in text
