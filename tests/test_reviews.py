"""Reviews on a live hub, over both databases: labels and notes stored with who and
when, the label filter, a bad trace never batched, an overridden reward used by the
threshold and exports, the review scope, and the review queue's leases. Also the list's
search, sorts and cursors, which the dashboard shares with GET /v1/traces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.builders import native_trace
from tests.support.databases import make_api_key
from tests.support.pipeline import ingest, set_rewards
from tests.support.processes import run_cli

THRESHOLD = 5.0


def review(client: httpx.Client, trace_id: str, **body: Any) -> httpx.Response:
    return client.post(f"/v1/traces/{trace_id}/review", json=body)


def ids(client: httpx.Client, **params: Any) -> list[str]:
    r = client.get("/v1/traces", params=params)
    assert r.status_code == 200, r.text
    return [t["trace_id"] for t in r.json()["traces"]]


def burst(config: Path) -> None:
    done = run_cli("worker", "--config", str(config), "--burst")
    assert done.returncode == 0, done.stderr


def test_a_review_is_kept_shown_and_filtered(client: httpx.Client) -> None:
    ingest(client, ["t0", "t1", "t2"])
    r = review(client, "t1", label="good", note="clean run, right answer")
    assert r.status_code == 200, r.text
    saved = r.json()
    assert saved["label"] == "good" and saved["reviewer"] == "anonymous"
    assert saved["note"] == "clean run, right answer" and saved["reward"] is None
    assert saved["trace_reward"] == client.get("/v1/traces/t1").json()["reward"]

    record = client.get("/v1/traces/t1").json()
    assert record["review"]["label"] == "good"
    assert record["review"]["reviewed_at"] == saved["reviewed_at"]
    assert record["label"] == "good"
    assert ids(client, label="good") == ["t1"]
    assert ids(client, label="unreviewed") == ["t2", "t0"]
    assert ids(client, label="bad") == []

    # A later review replaces the first.
    assert review(client, "t1", label="bad").status_code == 200
    assert client.get("/v1/traces/t1").json()["review"]["note"] is None
    assert ids(client, label="bad") == ["t1"] and ids(client, label="good") == []

    bad = review(client, "t1", label="meh")
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "label"
    assert review(client, "t1", label="good", reward="lots").status_code == 422
    missing = review(client, "nope", label="good")
    assert missing.status_code == 404 and missing.json()["error"]["field"] == "trace_id"
    assert client.get("/v1/traces", params={"label": "great"}).status_code == 422


@pytest.mark.process
async def test_bad_is_never_batched_and_an_override_is_the_reward(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "batches"
    hub = start_hub(trace_server, "--no-workers", distributor={
        "target": "jsonl", "batch_size": 2, "min_reward_threshold": THRESHOLD,
        "output_dir": str(out)})
    with hub.client() as client:
        ingest(client, ["t0", "t1", "t2", "t3"])
        await set_rewards(trace_server, {t: 10.0 for t in ["t0", "t1", "t2", "t3"]})
        assert review(client, "t0", label="bad").json()["trace_reward"] is not None
        # An override under the threshold keeps t1 out too, as its own reward would.
        assert review(client, "t1", label="good", reward=1).json()["trace_reward"] == 1
        burst(hub.config)
        stages = {t: client.get(f"/v1/traces/{t}").json()["stage"] for t in ["t0", "t1", "t2", "t3"]}
        assert stages["t2"] == stages["t3"] == "delivered"
        assert stages["t0"] in ("compressed", "compression_skipped")  # passing, but bad
        assert stages["t1"] == "below_threshold"
        assert client.get("/v1/traces/t1").json()["reward"] == 1

        # Raised over the threshold, t1 goes back through the stages; t0 relabelled good
        # (no override: its own reward again) joins it in the next batch.
        assert review(client, "t1", label="good", reward=9).json()["stage"] == "accepted"
        assert review(client, "t0", label="good").json()["reward"] is None
        burst(hub.config)
        batches = client.get("/v1/batches").json()["batches"]
        assert len(batches) == 2
        newest = client.get(f"/v1/batches/{batches[0]['batch_id']}").json()
        assert sorted(newest["trace_ids"]) == ["t0", "t1"]
        record = client.get("/v1/traces/t1").json()
        assert record["reward"] == 9 and record["review"]["reward"] == 9
        assert record["batch_id"] == newest["batch_id"]
        # A review of a trace already batched is kept; the trace stays in its batch.
        late = review(client, "t2", label="bad").json()
        assert late["stage"] == "delivered"

    export = tmp_path / "good.jsonl"
    done = run_cli("export", "--config", str(hub.config), "--format", "native",
                   "--label", "good", "--min-reward", "9", "-o", str(export))
    assert done.returncode == 0, done.stderr
    exported = [json.loads(line)["trace_id"] for line in export.read_text().splitlines()]
    assert sorted(exported) == ["t0", "t1"]  # t0 by its computed reward, t1 by its override

    # A bad trace is never batched, and never exported unless asked for: the summary
    # says it was left out and why.
    default = tmp_path / "default.jsonl"
    done = run_cli("export", "--config", str(hub.config), "--format", "native",
                   "-o", str(default))
    assert done.returncode == 0, done.stderr
    exported = [json.loads(line)["trace_id"] for line in default.read_text().splitlines()]
    assert sorted(exported) == ["t0", "t1", "t3"]
    assert "left out 1: 1 labelled bad" in done.stderr
    everything = tmp_path / "all.jsonl"
    done = run_cli("export", "--config", str(hub.config), "--format", "native", "--all",
                   "-o", str(everything))
    assert done.returncode == 0, done.stderr
    assert len(everything.read_text().splitlines()) == 4
    done = run_cli("export", "--config", str(hub.config), "--format", "native",
                   "--label", "bad", "--min-reward", "0", "-o", str(everything))
    assert [json.loads(line)["trace_id"] for line in everything.read_text().splitlines()] == ["t2"]


def test_reviewing_needs_the_review_scope(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    hub = start_hub(trace_server, auth={"enabled": True})
    ingester = make_api_key(trace_server, "ingest")
    reader = make_api_key(trace_server, "read")
    reviewer = make_api_key(trace_server, "review", name="alice")
    admin = make_api_key(trace_server, "admin", name="root")
    with hub.client(headers={"Authorization": f"Bearer {ingester}"}) as client:
        ingest(client, ["t0"])
    with hub.client() as client:
        def as_key(key: str, **body: Any) -> httpx.Response:
            response: httpx.Response = client.post("/v1/traces/t0/review", json=body,
                                                   headers={"Authorization": f"Bearer {key}"})
            return response

        assert client.post("/v1/traces/t0/review", json={"label": "good"}).status_code == 401
        refused = as_key(reader, label="good")
        assert refused.status_code == 403
        assert "review" in refused.json()["error"]["message"]
        assert as_key(reviewer, label="good").json()["reviewer"] == "alice"
        assert as_key(admin, label="bad").json()["reviewer"] == "root"
        assert client.post("/v1/review-queue/next",
                           headers={"Authorization": f"Bearer {reader}"}).status_code == 403


def test_the_queue_serves_each_trace_to_one_reviewer(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    hub = start_hub(trace_server, "--no-workers", auth={"enabled": True})
    admin = make_api_key(trace_server, "admin")
    alice = make_api_key(trace_server, "review", name="alice")
    bob = make_api_key(trace_server, "review", name="bob")
    with hub.client(headers={"Authorization": f"Bearer {admin}"}) as client:
        ingest(client, ["t0", "t1", "t2"])
        ingest(client, ["f0"], outcome={"status": "failure"})

        def next_for(key: str, **params: Any) -> str | None:
            r = client.post("/v1/review-queue/next", params=params,
                            headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            trace_id: str | None = r.json()["trace_id"]
            return trace_id

        assert next_for(alice) == "t0"
        assert next_for(bob) == "t1"  # t0 is alice's for now
        assert next_for(alice) == "t0"  # asking again: still hers
        assert next_for(alice, skip="t0") == "t2"  # t0 goes back to the queue
        assert next_for(bob, status="failure") == "f0"  # the queue takes the list's filters
        assert review(client, "t0", label="good").status_code == 200
        assert next_for(bob) == "t1"
        assert review(client, "t1", label="bad").status_code == 200
        assert review(client, "t2", label="good").status_code == 200
        assert next_for(alice, status="success") is None


def test_the_list_searches_sorts_and_pages(client: httpx.Client) -> None:
    tasks = {"s0": "Count the lines in notes.txt", "s1": "Fix the FLAKY test in ci.yml",
             "s2": "Rename the module " + "and its imports " * 40, "s3": "Find 100% of x_y"}
    for trace_id, task in tasks.items():
        r = client.post("/v1/traces", json=native_trace(trace_id=trace_id, task=task))
        assert r.status_code == 202, r.text
    answered = native_trace(trace_id="s4", task="Say hi")
    answered["steps"][-1]["content"] = "The answer is Kilimanjaro."
    assert client.post("/v1/traces", json=answered).status_code == 202
    unicode = native_trace(trace_id="s5", task="Öffne die DATEI")
    assert client.post("/v1/traces", json=unicode).status_code == 202

    assert ids(client, q="flaky") == ["s1"]  # case folded
    assert ids(client, q="KILIMANJARO") == ["s4"]  # the final answer too
    assert ids(client, q="100%") == ["s3"] and ids(client, q="x_y") == ["s3"]
    assert ids(client, q="0% of xy") == []
    assert ids(client, q="notes.txt", status="failure") == []
    assert ids(client, q="ÖFFNE die") == ["s5"]  # beyond ASCII, on both databases

    tokens = {t["trace_id"]: t["total_tokens"] for t in client.get("/v1/traces").json()["traces"]}
    by_tokens = ids(client, sort="-total_tokens")
    assert [tokens[t] for t in by_tokens] == sorted(tokens.values(), reverse=True)
    assert by_tokens[0] == "s2"
    assert ids(client, sort="created_at") == ["s0", "s1", "s2", "s3", "s4", "s5"]

    seen: list[str] = []
    params: dict[str, Any] = {"sort": "total_tokens", "limit": 2}
    while True:
        page = client.get("/v1/traces", params=params).json()
        seen += [t["trace_id"] for t in page["traces"]]
        if page["next_cursor"] is None:
            break
        params["cursor"] = page["next_cursor"]
    assert seen == list(reversed(by_tokens))  # ties broken by trace_id, both ways
    wrong = client.get("/v1/traces", params={"cursor": params["cursor"]})
    assert wrong.status_code == 400 and wrong.json()["error"]["field"] == "cursor"
    assert client.get("/v1/traces", params={"sort": "tokens"}).status_code == 422


def test_the_list_shows_task_and_answer_and_a_search_where_it_matched(
    client: httpx.Client,
) -> None:
    long_task = "Rename   the\nmodule " + "and its imports " * 40
    plain = native_trace(trace_id="p0", task=long_task)
    unanswered = native_trace(trace_id="p1", task="Fix the FLAKY test")
    unanswered["steps"] = unanswered["steps"][:-1]
    answered = native_trace(trace_id="p2", task="Say hi")
    answered["steps"][-1]["content"] = ("It took a while. " * 10 + "The answer is "
                                        "Kilimanjaro, the highest mountain. " + "Done. " * 20)
    for trace in (plain, unanswered, answered):
        assert client.post("/v1/traces", json=trace).status_code == 202

    listed = {t["trace_id"]: t for t in client.get("/v1/traces").json()["traces"]}
    task = listed["p0"]["task"]
    assert task.startswith("Rename the module and its imports") and task.endswith("…")
    assert len(task) == 120 and "\n" not in task and "  " not in task
    assert listed["p0"]["final_answer"] == "notes.txt has 12 lines."
    assert listed["p1"] == {**listed["p1"], "task": "Fix the FLAKY test", "final_answer": None}
    assert listed["p2"]["final_answer"].endswith("…") and "snippet" in listed["p2"]
    assert listed["p2"]["snippet"] is None  # no search, no snippet

    page = client.get("/v1/traces", params={"q": "kilimanjaro"}).json()
    [found] = page["traces"]
    assert page["matches"] == 1
    # The words around the match, in the text's own case, cut on both sides.
    assert found["snippet"].startswith("…") and found["snippet"].endswith("…")
    assert "The answer is Kilimanjaro, the highest mountain." in found["snippet"]
    assert client.get("/v1/traces", params={"q": "flaky"}).json()["traces"][0]["snippet"] == (
        "Fix the FLAKY test")
    # The count is of every match, not of the page.
    counted = client.get("/v1/traces", params={"q": "the", "limit": 1}).json()
    assert len(counted["traces"]) == 1 and counted["matches"] == 3
    assert client.get("/v1/traces").json()["matches"] is None
    record = client.get("/v1/traces/p1").json()
    assert record["task"] == "Fix the FLAKY test" and record["final_answer"] is None
