"""The compression stage in a running hub and in `atropos worker`, on real long traces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from app.db.models import TRACES
from app.db.types import utcnow
from tests.support import ROOT
from tests.support.builders import long_trace, native_trace
from tests.support.databases import db_execute
from tests.support.fakes.model_server import FakeModel
from tests.support.hubs import InProcessHub, write_config
from tests.support.metrics import scrape, value
from tests.support.processes import WorkerProcess, run_cli
from tests.support.real_traces import OPENHANDS, SWE_AGENT, load
from tests.support.waiting import wait_until

DONE = {"compressed", "compression_skipped", "compression_failed"}
# Some real runs are rejected by the default filters (error streaks); these tests are
# about compression, so every trace is let through.
ACCEPT_ALL: dict[str, Any] = {"invalid_trace_filters": []}
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
    records: dict[str, Any] = {}

    def done() -> bool:
        records.update({t: client.get(f"/v1/traces/{t}").json() for t in trace_ids})
        return all(r["stage"] in DONE for r in records.values())

    wait_until(done, timeout, what="compression to finish", poll=0.2)
    return records


def leases_expired(trace_server: dict[str, Any]) -> bool:
    [row] = db_execute(trace_server, sa.select(sa.func.max(TRACES.c.lease_expires_at).label("until")))
    return row["until"] is None or row["until"] <= utcnow()


def test_long_real_traces_are_compressed_and_short_ones_skipped(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    hub = start_hub(trace_server, "--compression", compression_file(tmp_path),
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
            # Every call and its result kept, these runs still come to under half.
            assert record["total_tokens"] >= 2 * record["compressed_tokens"]
            assert 500 <= record["compressed_tokens"] <= 8000 or info["over_limit"]
            view = client.get(f"/v1/traces/{trace_id}", params={"view": "compressed"}).json()
            compressed = view["trace"]
            original = client.get(f"/v1/traces/{trace_id}").json()["trace"]
            assert compressed["metadata"]["sft_only"] is True
            assert compressed["task"] == original["task"]
            errors = [s for s in original["steps"] if s.get("error")]
            kept = [s for s in compressed["steps"] if s.get("error")]
            assert len(kept) == len(errors)
            # (An exact repeat collapses into the first: distinct calls all stay.)
            def calls(trace: dict[str, Any]) -> set[str]:
                return {json.dumps([s.get("tool"), s.get("arguments")], sort_keys=True)
                        for s in trace["steps"] if s["type"] == "action"}
            assert calls(compressed) == calls(original)

        assert records["short"]["stage"] == "compression_skipped"
        assert "min_tokens_after" in records["short"]["compression"]["skipped"]
        stats = client.get("/v1/stats").json()["compression"]
        assert stats["compressed"] == len(long_ids) and stats["skipped"] == 1
        assert 0 < stats["mean_ratio"] <= 1 / 2
    # The per-trace "compression skipped" line is DEBUG: not in the INFO log.
    assert "compression skipped: trace short" not in hub.log


def test_a_trace_compression_keeps_whole_enters_past_the_stages_with_its_reasons(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    """Written once, where the stages would have moved it: with no stage running
    (--no-workers), a short trace is compression_skipped, or below_threshold under the
    threshold, its reason recorded and counted as the compression stage does; a long one
    is compressed by its ingest process (key_decision_extract needs no model), with its
    record, and counted as the stage counts its own."""
    hub = start_hub(trace_server, "--compression", compression_file(tmp_path), "--no-workers",
                    environment=ACCEPT_ALL,
                    distributor={"min_reward_threshold": 25, "batch_size": 100_000})
    with hub.client() as client:
        before = scrape(client)[1]
        posts = {
            "passing": native_trace(trace_id="passing"),  # task_success + code_runs_ok: 30
            "under": native_trace(trace_id="under", outcome={"status": "failure"}),  # 10
            "long": long_trace("long"),
        }
        answers = {name: client.post("/v1/traces", json=body).json()
                   for name, body in posts.items()}
        records = {name: client.get(f"/v1/traces/{name}").json() for name in posts}
        stats = client.get("/v1/stats").json()
        after = scrape(client)[1]
    assert {name: a["stage"] for name, a in answers.items()} == {
        "passing": "compression_skipped", "under": "below_threshold", "long": "compressed"}
    assert {name: r["stage"] for name, r in records.items()} == {
        name: a["stage"] for name, a in answers.items()}
    assert records["under"]["reward"] < 25 <= records["passing"]["reward"]
    for name in ("passing", "under"):
        assert records[name]["compression"] == {"skipped": (
            f"ratio x total_tokens = 0.3 x {records[name]['total_tokens']} = "
            f"{0.3 * records[name]['total_tokens']:.0f} < min_tokens_after 500")}
    long = records["long"]
    assert long["compression"]["strategy"] == "key_decision_extract"
    assert long["compressed_tokens"] == long["compression"]["tokens_after"] < long["total_tokens"]
    assert stats["by_stage"] == {"compression_skipped": 1, "below_threshold": 1, "compressed": 1}
    assert stats["compression"]["skipped"] == 2 and stats["compression"]["compressed"] == 1

    def counted(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert counted("atropos_compressions_total", outcome="skipped") == 2
    assert counted("atropos_compressions_skipped_total", reason="small") == 2
    assert counted("atropos_compressions_total", outcome="compressed") == 1
    assert counted("atropos_compression_input_tokens_total",
                   strategy="key_decision_extract") == long["total_tokens"]
    assert counted("atropos_traces_ingested_total", outcome="accepted") == 3


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


@pytest.mark.process
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
        wait_until(lambda: client.get("/v1/stats").json()["compression"]["compressed"] >= 5,
                   60, what="five traces compressed")
    first.kill()
    first.communicate()
    wait_until(lambda: leases_expired(trace_server), 10, what="the dead worker's leases to expire")
    burst = subprocess.run([*cmd, "--burst"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
    assert burst.returncode == 0, burst.stderr
    with hub.client() as client:
        records = wait_until_done(client, ids, timeout=5)
    assert {r["stage"] for r in records.values()} <= {"compressed", "compression_skipped"}
    assert "lease lost" not in burst.stderr


# --- a failing, hanging or slow model -------------------------------------

KEY_ENV = "FAKE_SUMMARY_KEY"
FAST_RETRY = {"max_attempts": 3, "base_seconds": 0.3, "max_seconds": 1}


def summarizing(tmp_path: Path, model_root: str, monkeypatch: Any, *, timeout: float = 5,
                **policy: Any) -> list[str]:
    """The --compression and --tinker arguments of a hub that summarizes with the fake
    model (no retries inside a call: each attempt of the stage is one request)."""
    monkeypatch.setenv(KEY_ENV, FakeModel.key)
    tinker = tmp_path / "tinker.json"
    tinker.write_text(json.dumps({"tinker": {
        "base_url": f"{model_root}/v1", "api_key_env": KEY_ENV, "max_retries": 0,
        "timeout_seconds": timeout}}))
    settings = {"strategy": "summarize_middle", "min_tokens_after": 200,
                "summary_target_tokens": 60, "protect_last_n_turns": 2, **policy}
    return ["--compression", compression_file(tmp_path, **settings), "--tinker", str(tinker)]


def holding_long_traces(
    start_hub: Any, trace_server: dict[str, Any], ids: list[str], files: list[str]
) -> InProcessHub:
    """An API without workers (the test runs its own) that has taken long traces `ids`,
    by the config `files` its workers go by (which traces enter past compression)."""
    hub: InProcessHub = start_hub(trace_server, "--no-workers", *files, environment=ACCEPT_ALL,
                                distributor=NO_BATCHES)
    with hub.client() as client:
        for trace_id in ids:
            assert client.post("/v1/traces", json=long_trace(trace_id, steps=12)).status_code == 202
    return hub


def warnings_about_the_model(hub: InProcessHub) -> list[str]:
    return [line for line in hub.lines if " WARNING " in line and "summary model" in line]


def test_a_model_outage_retries_then_fails_the_trace_and_is_said_once(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path, fake_model: FakeModel,
    model_root: str, monkeypatch: Any,
) -> None:
    """on_model_failure `retry` (the default): while the model is down each trace is
    retried by compression.retry, then compression_failed with the model's error;
    the outage is one WARNING, and traces are summarized again once it answers."""
    fake_model.down = "503"
    hub = start_hub(trace_server, *summarizing(tmp_path, model_root, monkeypatch,
                                               retry=FAST_RETRY),
                    environment=ACCEPT_ALL, distributor=NO_BATCHES)
    with hub.client() as client:
        for n in range(3):
            assert client.post("/v1/traces", json=long_trace(f"down-{n}", steps=12)).status_code == 202
        records = wait_until_done(client, [f"down-{n}" for n in range(3)])
        assert {r["stage"] for r in records.values()} == {"compression_failed"}
        assert len(fake_model.chats()) == 9  # three attempts each
        stats = client.get("/v1/stats").json()["compression"]
        assert (stats["failed"], stats["fallbacks"], stats["compressed"]) == (3, 0, 0)
        assert len(warnings_about_the_model(hub)) == 1

        fake_model.down = None
        assert client.post("/v1/traces", json=long_trace("back", steps=12)).status_code == 202
        back = wait_until_done(client, ["back"])["back"]
    assert back["stage"] == "compressed"
    assert (back["compression"]["strategy"], back["compression"]["fallback"]) == (
        "summarize_middle", None)
    hub.wait_for_log("the summary model answers again")
    assert len(warnings_about_the_model(hub)) == 1


def test_with_fallback_an_outage_compresses_by_extraction_after_the_retries_and_counts_it(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path, fake_model: FakeModel,
    model_root: str, monkeypatch: Any,
) -> None:
    """Traces fell back to key_decision_extract at the model's first failure, silently,
    and were never summarized once it came back. With on_model_failure
    `fallback` the fallback comes after the retries, is counted in /v1/stats, and the
    outage is logged at WARNING once, not per trace."""
    fake_model.down = "503"
    hub = start_hub(trace_server, *summarizing(tmp_path, model_root, monkeypatch,
                                               retry=FAST_RETRY, on_model_failure="fallback"),
                    environment=ACCEPT_ALL, distributor=NO_BATCHES)
    ids = [f"fb-{n}" for n in range(3)]
    with hub.client() as client:
        for trace_id in ids:
            assert client.post("/v1/traces", json=long_trace(trace_id, steps=12)).status_code == 202
        records = wait_until_done(client, ids)
        for record in records.values():
            assert record["stage"] == "compressed"
            info = record["compression"]
            assert info["strategy"] == "key_decision_extract"
            assert info["fallback"].startswith("the summary model failed")
        assert len(fake_model.chats()) == 9  # retried before falling back
        stats = client.get("/v1/stats").json()["compression"]
        assert (stats["compressed"], stats["fallbacks"], stats["failed"]) == (3, 3, 0)
        assert len(warnings_about_the_model(hub)) == 1
        assert "key_decision_extract (compression.on_model_failure: fallback)" in (
            warnings_about_the_model(hub)[0])
    # Each trace's fallback is detail (DEBUG), not news: INFO has none of them.
    assert "compressed with key_decision_extract: the summary model" not in hub.log


def test_a_hanging_model_holds_up_no_trace_that_does_not_need_it(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path, fake_model: FakeModel,
    model_root: str, monkeypatch: Any,
) -> None:
    """With the model hanging, 14 short traces waited ~85 s behind 2 long ones and
    batching waited too: skips are written at once, and distribution runs
    on its own schedule."""
    fake_model.down = ("slow", 120)  # hangs past the client's timeout
    hub = start_hub({**trace_server, "flush_interval_seconds": 60},
                    *summarizing(tmp_path, model_root, monkeypatch, timeout=60),
                    environment=ACCEPT_ALL,
                    distributor={"target": "jsonl", "output_dir": str(tmp_path / "batches"),
                                 "batch_size": 14, "min_reward_threshold": -1e9})
    with hub.client() as client:
        for trace_id in ("long-0", "long-1"):
            assert client.post("/v1/traces", json=long_trace(trace_id, steps=12)).status_code == 202
        wait_until(lambda: fake_model.in_flight == 2, timeout=10, what="both calls hanging")
        short = [f"short-{n}" for n in range(14)]
        for trace_id in short:
            assert client.post("/v1/traces", json=native_trace(trace_id=trace_id)).status_code == 202
        # Skipped, batched and delivered (jsonl) while both model calls still hang.
        wait_until(lambda: client.get("/v1/stats").json()["by_stage"].get("delivered") == 14,
                   timeout=10, what="the short traces skipped, batched and delivered")
        assert fake_model.in_flight == 2
        assert {client.get(f"/v1/traces/long-{n}").json()["stage"] for n in (0, 1)} == {
            "accepted"}  # still with the model


@pytest.mark.process
def test_model_calls_run_concurrently_up_to_the_bound(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path, fake_model: FakeModel,
    model_root: str, monkeypatch: Any,
) -> None:
    """`atropos worker --burst` drains them, model calls in flight included."""
    fake_model.delay = 0.5
    files = summarizing(tmp_path, model_root, monkeypatch, max_concurrent_calls=3)
    ids = [f"c-{n}" for n in range(7)]
    hub = holding_long_traces(start_hub, trace_server, ids, files)
    with hub.client() as client:
        burst = run_cli("worker", "--config", str(hub.config), *files, "--burst")
        assert burst.returncode == 0, burst.stderr
        records = wait_until_done(client, ids, timeout=1)
    assert {r["compression"]["strategy"] for r in records.values()} == {"summarize_middle"}
    assert len(fake_model.chats()) == 7
    assert fake_model.most_in_flight == 3


@pytest.mark.process
def test_a_model_slower_than_the_lease_summarizes_each_trace_once(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path, fake_model: FakeModel,
    model_root: str, monkeypatch: Any,
) -> None:
    """With 8 s model calls and two workers, 26 calls were made for 24 traces: the
    lease ran out mid-call and the other worker took the trace. The lease
    is renewed while the call runs."""
    fake_model.delay = 6  # longer than the lease
    files = summarizing(tmp_path, model_root, monkeypatch, timeout=30, max_concurrent_calls=2)
    ids = [f"slow-{n}" for n in range(6)]
    hub = holding_long_traces(start_hub, trace_server, ids, files)
    config = write_config(tmp_path, {**trace_server, "flush_interval_seconds": 0.2},
                          workers={"lease_seconds": 5}, environment=ACCEPT_ALL,
                          distributor=NO_BATCHES)
    workers = [WorkerProcess(config, *files).start() for _ in range(2)]
    try:
        with hub.client() as client:
            records = wait_until_done(client, ids, timeout=60)
        assert {r["compression"]["strategy"] for r in records.values()} == {"summarize_middle"}
        assert len(fake_model.chats()) == len(ids)
        for worker in workers:
            assert "lease lost" not in worker.log
    finally:
        for worker in workers:
            worker.kill()


def test_an_empty_or_growing_summary_fails_the_trace_under_retry(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path, fake_model: FakeModel,
    model_root: str, monkeypatch: Any,
) -> None:
    """An empty summary fell back to key_decision_extract, and a summary that made the
    trace larger was delivered. Under on_model_failure `retry` both are the model
    failing: retried, then compression_failed with what was wrong; nothing compressed."""
    fake_model.reply = lambda body: ""
    hub = start_hub(trace_server, *summarizing(tmp_path, model_root, monkeypatch,
                                               retry=FAST_RETRY),
                    environment=ACCEPT_ALL, distributor=NO_BATCHES)
    with hub.client() as client:
        assert client.post("/v1/traces", json=long_trace("empty", steps=12)).status_code == 202
        empty = wait_until_done(client, ["empty"])["empty"]
        fake_model.reply = lambda body: "[CONTEXT SUMMARY]: " + "garbage " * 5000
        assert client.post("/v1/traces", json=long_trace("growing", steps=12)).status_code == 202
        growing = wait_until_done(client, ["growing"])["growing"]
        stats = client.get("/v1/stats").json()["compression"]
    assert (empty["stage"], growing["stage"]) == ("compression_failed", "compression_failed")
    assert "SummaryRefused: the summary model returned an empty summary" in empty["stage_error"]
    assert "makes the trace no shorter" in growing["stage_error"]
    assert len(fake_model.chats()) == 6  # three attempts each
    assert (stats["compressed"], stats["fallbacks"], stats["failed"]) == (0, 0, 2)


def test_the_periodic_summary_says_compression_skipped_with_the_reasons(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    """Seed 002 tells users to look for `compression skipped` in the log; per-trace lines
    are DEBUG, so the INFO summary says it, with how many and why."""
    hub = start_hub(trace_server | {"log_summary_seconds": 0.3},
                    "--compression", compression_file(tmp_path),
                    environment=ACCEPT_ALL, distributor=NO_BATCHES)
    with hub.client() as client:
        for n in range(3):
            assert client.post("/v1/traces", json=native_trace(trace_id=f"s-{n}")).status_code == 202
        wait_until_done(client, [f"s-{n}" for n in range(3)])
    def skipped() -> int:
        """The traces the INFO summary lines say were skipped as small."""
        lines = [line for line in hub.lines
                 if " INFO atropos.summary: " in line and " compression skipped (" in line]
        return sum(int(line.split(" compression skipped (small ")[1].split(")")[0])
                   for line in lines)

    wait_until(lambda: skipped() == 3, timeout=10, what="3 skips in the summary lines")


@pytest.mark.process
def test_a_burst_worker_says_what_it_compressed_and_skipped(
    trace_server: dict[str, Any], tmp_path: Path
) -> None:
    """`atropos worker --burst` ends before a periodic summary is due: its last line
    says what compression did, skips with their reasons. The traces come from
    `atropos import`, which leaves every decision to the stages (a hub decides a small
    trace's skip as it stores it)."""
    [ctf] = [p for p in SWE_AGENT if p.name == "ctf_web_i_got_id_demo.traj"]
    config = write_config(tmp_path, trace_server, environment=ACCEPT_ALL,
                          distributor=NO_BATCHES)
    traces = tmp_path / "traces.jsonl"
    traces.write_text("".join(json.dumps(t) + "\n" for t in [
        as_native(ctf, "long"), *(native_trace(trace_id=f"s-{n}") for n in range(2))]))
    imported = run_cli("import", "--config", str(config), str(traces))
    assert imported.returncode == 0, imported.stderr
    burst = run_cli("worker", "--config", str(config), "--compression",
                    str(ROOT / "compression.json.example"), "--burst")
    assert burst.returncode == 0, burst.stderr
    [done] = [line for line in burst.stderr.splitlines() if "burst done: " in line]
    assert " INFO " in done
    assert "1 compressed, 2 compression skipped (small 2)" in done
