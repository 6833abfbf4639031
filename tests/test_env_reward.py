"""The environment's own reward, first-class: read where agents put it, stored in the
`env_reward` column, weighted into `reward` by environment.env_reward, shown in every
view, filterable, counted in /v1/stats, in the batch manifest; and `atropos rescore`
brings traces stored before it up to date. Over HTTP on a live hub, both databases."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from app.db import migrate
from app.db.models import TRACES
from app.db.types import JSON_, utcnow
from app.domain import Outcome, Status, Trace
from tests.support.builders import native_trace
from tests.support.databases import database, db_execute
from tests.support.hubs import write_config
from tests.support.waiting import wait_until
from tests.test_import import run

# The seed example: a verifier's 0.01, no status.
EXAMPLE = {
    "format": "openai",
    "messages": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
    ],
    "reward": 0.01,
}


def post(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post("/v1/traces", json=body)
    assert r.status_code == 202, r.text
    answer: dict[str, Any] = r.json()
    return answer


def test_the_seed_example_scores_0_2_status_unknown_and_stays_below_the_threshold(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    hub = start_hub(trace_server)  # default rules, threshold 5, background stages on
    with hub.client() as client:
        answer = post(client, {**EXAMPLE, "trace_id": "seed"})
        assert answer["status"] == "unknown"
        assert answer["reward"] == 0.2 and answer["env_reward"] == 0.01
        assert answer["reward_breakdown"]["env_reward"] == {
            "fired": True, "count": 1, "points": 0.2}
        assert answer["reward_breakdown"]["task_success"]["fired"] is False

        def stage() -> str | None:
            found: str = client.get("/v1/traces/seed").json()["stage"]
            return found if found == "below_threshold" else None

        wait_until(stage, what="the trace to be judged below the threshold")
        assert client.get("/v1/batches").json()["batches"] == []


def test_every_view_shows_it_and_the_list_filters_on_it(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    hub = start_hub(trace_server, "--no-workers")
    with hub.client() as client:
        post(client, {**EXAMPLE, "trace_id": "low"})
        post(client, native_trace(trace_id="mid", outcome={"status": "success", "reward": 0.5}))
        post(client, {"conversations": [{"from": "human", "value": "hi"},
                                        {"from": "gpt", "value": "hello"}],
                      "trace_id": "high", "reward": 1})
        post(client, native_trace(trace_id="none"))

        mid = client.get("/v1/traces/mid").json()
        assert (mid["env_reward"], mid["status"], mid["reward"]) == (0.5, "success", 40.0)
        assert mid["trace"]["outcome"]["reward"] == 0.5
        original = client.get("/v1/traces/mid", params={"view": "original"}).json()
        assert original["env_reward"] == 0.5
        assert client.get("/v1/traces/none").json()["env_reward"] is None
        listed = {t["trace_id"]: t["env_reward"]
                  for t in client.get("/v1/traces").json()["traces"]}
        assert listed == {"low": 0.01, "mid": 0.5, "high": 1.0, "none": None}

        def ids(**params: Any) -> set[str]:
            page = client.get("/v1/traces", params=params).json()["traces"]
            return {t["trace_id"] for t in page}

        assert ids(min_env_reward=0.5) == {"mid", "high"}
        assert ids(max_env_reward=0.5) == {"low", "mid"}
        assert ids(min_env_reward=0.1, max_env_reward=0.9) == {"mid"}
        assert ids(min_env_reward=2) == set()
        bad = client.get("/v1/traces", params={"min_env_reward": "lots"})
        assert bad.status_code == 422 and "min_env_reward" in bad.text

        stats = client.get("/v1/stats").json()
        env = stats["env_reward"]
        assert env["traces"] == 3
        assert abs(env["mean"] - (0.01 + 0.5 + 1.0) / 3) < 1e-9
        assert stats["rule_firings"]["env_reward"] == 3
        # mid (40) and high (20 x 1) reach the threshold; low (0.2) does not.
        assert (env["passing"], env["threshold"]) == (2, 5)
        assert abs(env["passing_share"] - 2 / 3) < 1e-9
        histogram = env["histogram"]
        assert len(histogram) == 10 and histogram[0]["from"] == 0.01
        assert histogram[-1]["to"] == 1.0  # the highest is in the last bucket
        assert [b["traces"] for b in histogram] == [1, 0, 0, 0, 1, 0, 0, 0, 0, 1]


def test_the_weight_is_configurable(start_hub: Any, trace_server: dict[str, Any]) -> None:
    hub = start_hub(trace_server, "--no-workers", environment={"env_reward": {"weight": 100}})
    with hub.client() as client:
        assert post(client, EXAMPLE)["reward"] == 1.0


def test_a_bad_weight_stops_start_up_with_one_line(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db")},
                          environment={"env_reward": {"weight": "lots"}})
    result = run("serve", "--config", str(config))
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "environment.env_reward.weight" in line


def test_the_batch_manifest_and_the_http_batch_carry_it(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    hub = start_hub(trace_server, distributor={
        "target": "jsonl", "output_dir": str(out), "batch_size": 2, "min_reward_threshold": 0})
    with hub.client() as client:
        post(client, {**EXAMPLE, "trace_id": "a"})
        post(client, native_trace(trace_id="b"))
    manifest = out / "manifest.jsonl"
    wait_until(manifest.exists, what="the batch to be written")
    [entry] = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert entry["trace_ids"] == ["a", "b"]
    assert entry["env_rewards"] == [0.01, None]
    assert entry["rewards"] == [0.2, 30.0]


# --- atropos rescore: traces stored before revision 0006 -----------------------------


def _old_row(trace_id: str, original: Any, trace: Trace, reward: float) -> dict[str, Any]:
    """A row as the hub stored it before 0006: a status inferred from the reward, the
    reward itself only in metadata, no env_reward column."""
    now = utcnow()
    return {
        "trace_id": trace_id, "created_at": now, "updated_at": now,
        "status": trace.outcome.status.value, "stage": "accepted", "total_tokens": 10,
        "reward": reward, "reward_breakdown": {}, "reject_reasons": [],
        "scored_with": "before0006", "source_format": trace.source_format,
        "content_hash": "h", "original": original,
        "trace": trace.model_dump(mode="json", exclude_none=True), "attempts": 0,
    }


async def _store_before_0006(trace_server: dict[str, Any]) -> None:
    openai = Trace(task="What is 2+2?", outcome=Outcome(status=Status.SUCCESS),
                   metadata={"reward": 0.01}, source_format="openai")
    tau = Trace(task="book it", outcome=Outcome(status=Status.SUCCESS, reason="reward 1.0"),
                metadata={"task_id": 1, "reward": 1.0,
                          "imported_from": {"format": "tau_bench", "location": "x.json#0"}})
    plain = Trace(task="t", outcome=Outcome(status=Status.FAILURE), source_format="native")
    rows = [
        _old_row("openai-old", EXAMPLE, openai, 20.0),
        _old_row("tau-old", tau.model_dump(mode="json", exclude_none=True), tau, 20.0),
        _old_row("native-old", {"task": "t", "steps": []}, plain, 0.0),
    ]
    async with database(trace_server) as engine:
        await migrate.upgrade(engine, "0005")
        async with engine.begin() as conn:
            # The rows name no env_reward (the column 0005 lacks) and carry the payloads,
            # in `traces` until 0025.
            before = sa.Table("traces", sa.MetaData(), *(
                sa.Column(name, TRACES.c[name].type if name in TRACES.c else JSON_)
                for name in rows[0]))
            await conn.execute(sa.insert(before), rows)
        await migrate.upgrade(engine)


def test_rescore_fills_env_reward_and_undoes_inferred_statuses(
    empty_trace_server: dict[str, Any], tmp_path: Path
) -> None:
    trace_server = empty_trace_server  # rows stored before revision 0006
    asyncio.run(_store_before_0006(trace_server))
    config = write_config(tmp_path, trace_server)
    result = run("rescore", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert "rescored: 3" in result.stdout and "outcomes read again: 2" in result.stdout

    rows = {r["trace_id"]: r for r in db_execute(
        trace_server, "SELECT trace_id, status, reward, env_reward, trace "
                      "FROM traces JOIN trace_payloads USING (trace_id)")}
    for row in rows.values():
        if isinstance(row["trace"], str):  # SQLite hands JSON back as text
            row["trace"] = json.loads(row["trace"])
    openai, tau, plain = rows["openai-old"], rows["tau-old"], rows["native-old"]
    assert (openai["status"], openai["env_reward"]) == ("unknown", 0.01)
    assert abs(openai["reward"] - 0.2) < 1e-9
    assert openai["trace"]["outcome"] == {"status": "unknown", "reward": 0.01}
    assert (tau["status"], tau["env_reward"], tau["reward"]) == ("unknown", 1.0, 20.0)
    assert tau["trace"]["outcome"] == {"status": "unknown", "reward": 1.0}
    # Nothing to read again: the reported failure stays, with no env_reward.
    assert (plain["status"], plain["env_reward"], plain["reward"]) == ("failure", None, 0.0)
    assert run("rescore", "--config", str(config)).stdout.startswith("nothing to rescore")


# --- rewards out of range ---------------------------------------------------------------


def test_non_finite_and_absurd_rewards_are_refused_naming_the_field(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    hub = start_hub(trace_server, "--no-workers")
    with hub.client() as client:
        for sent, field in ((1e308, "reward"), (-2e6, "reward"), (6e4, "reward")):
            # 1e308 is a finite float, 20 x 1e308 is not; 6e4 x 20 is past 1e6.
            r = client.post("/v1/traces", json={**EXAMPLE, "reward": sent})
            assert r.status_code == 422, (sent, r.text)
            assert r.json()["error"]["field"] == field
            assert "out of range" in r.json()["error"]["message"]
        r = client.post("/v1/traces", content=b'{"messages": [{"role": "user", "content": "a"},'
                        b'{"role": "assistant", "content": "b"}], "reward": 1e400}',
                        headers={"content-type": "application/json"})
        assert r.status_code == 400 and "infinity" in r.text
        assert post(client, {**EXAMPLE, "reward": 5e4 / 20})["reward"] == 5e4
        assert client.get("/v1/stats").json()["traces"] == 1


def test_a_review_override_is_bounded(start_hub: Any, trace_server: dict[str, Any]) -> None:
    hub = start_hub(trace_server, "--no-workers")
    with hub.client() as client:
        post(client, {**EXAMPLE, "trace_id": "r"})
        for reward in (1e7, -1e300):
            r = client.post("/v1/traces/r/review", json={"label": "good", "reward": reward})
            assert r.status_code == 422 and "reward" in r.text
        r = client.post("/v1/traces/r/review", json={"label": "good", "reward": 1e6})
        assert r.status_code == 200, r.text
        assert client.get("/v1/traces/r").json()["reward"] == 1e6


def test_extreme_and_infinite_stored_rewards_keep_ui_and_stats_small_and_200(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    """The widest rewards the hub takes, and rows stored before rewards were bounded
    holding infinity: every page answers, and the histogram has a fixed number of bars
    (it drew each empty 5-point bucket between the lowest reward and the highest)."""
    hub = start_hub(trace_server, "--no-workers")
    with hub.client() as client:
        for tid, reward in (("low", -1e6 / 20), ("high", 1e6 / 20), ("inf", 1.0),
                            ("minus-inf", 1.0)):
            post(client, {**EXAMPLE, "trace_id": tid, "reward": reward})
        for tid, value in (("inf", "inf"), ("minus-inf", "-inf")):
            db_execute(trace_server, sa.update(TRACES).where(TRACES.c.trace_id == tid)
                       .values(reward=float(value), env_reward=float(value)))
        stats = client.get("/v1/stats")
        assert stats.status_code == 200, stats.text
        buckets = stats.json()["reward_histogram"]
        assert sum(b["traces"] for b in buckets) == 2  # the infinite ones are in none
        env_buckets = stats.json()["env_reward"]["histogram"]
        assert sum(b["traces"] for b in env_buckets) == 2 and len(env_buckets) == 10
        page = client.get("/ui")
        assert page.status_code == 200
        assert len(page.content) < 200_000
        assert page.text.count(" to ") <= 40  # the histogram's bar labels, and few others
        assert "-1e+06 to" in page.text
        for tid in ("inf", "minus-inf", "high"):
            assert client.get(f"/v1/traces/{tid}").status_code == 200
            assert client.get(f"/ui/traces/{tid}").status_code == 200
        assert client.get("/ui/traces", params={"sort": "-reward"}).status_code == 200
        assert client.get("/v1/traces", params={"sort": "-reward"}).status_code == 200
