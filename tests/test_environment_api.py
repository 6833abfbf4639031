"""Reward rules and filters through the HTTP API of a live hub: each fires and does not
fire at its edges, rejected traces are stored and scored, stats count them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.domain import Step
from tests.support import ROOT
from tests.support.builders import action, final, native_trace, observation, thought
from tests.support.hubs import write_config


def call(tool: str = "terminal") -> Step:
    """A tool call with valid arguments."""
    return action(tool, {"command": "ls"})


FINAL = final("done")


@pytest.fixture
def env_client(start_hub: Any, trace_server: dict[str, Any]) -> Any:
    """A hub with the environment section given; workers off, so stages stay put."""
    clients: list[httpx.Client] = []

    def make(environment: dict[str, Any]) -> httpx.Client:
        hub = start_hub(trace_server, "--no-workers", environment=environment)
        clients.append(hub.client())
        return clients[-1]

    yield make
    for c in clients:
        c.close()


def post(client: httpx.Client, steps: list[Any], **extra: Any) -> dict[str, Any]:
    r = client.post("/v1/traces", json=native_trace(steps=steps, **extra))
    assert r.status_code == 202, r.text
    answer: dict[str, Any] = r.json()
    return answer


SEED = {
    "reward_rules": {"task_success": 20, "code_runs_ok": 10, "invalid_tool_call": -5,
                     "loop_detected": -10, "timeout": -15},
    "invalid_trace_filters": ["repeated_thought", "empty_action", "tool_error_streak"],
}


def test_seed_rules_at_their_edges(env_client: Any) -> None:
    client = env_client(SEED)
    ok = post(client, [call(), observation(exit_code=0), FINAL])
    assert ok["reward"] == 30 and ok["stage"] == "compression_skipped"  # not rejected
    assert ok["reward_breakdown"]["task_success"] == {"fired": True, "count": 1, "points": 20.0}
    assert ok["reward_breakdown"]["code_runs_ok"]["fired"] is True

    failing = post(client, [call(), observation(exit_code=1), FINAL],
                   outcome={"status": "failure"})
    assert failing["reward"] == 0
    assert not failing["reward_breakdown"]["code_runs_ok"]["fired"]

    timeout = post(client, [call(), FINAL], outcome={"status": "timeout"})
    assert timeout["reward"] == -15

    # invalid_tool_call counts per occurrence: arguments not an object, twice.
    bad_args = post(client, [{"type": "action", "tool": "t", "arguments": "not json"},
                             {"type": "action", "tool": "t", "arguments": [1]}, FINAL],
                    outcome={"status": "failure"})
    assert bad_args["reward_breakdown"]["invalid_tool_call"] == {
        "fired": True, "count": 2, "points": -10.0}
    # A tool missing from the declared tool list is invalid too.
    undeclared = post(client, [call("rm"), FINAL], tools=["terminal"],
                      outcome={"status": "failure"})
    assert undeclared["reward_breakdown"]["invalid_tool_call"]["count"] == 1

    # loop_detected: 2 identical actions in a row do not fire, 3 do (thoughts between).
    two = [call(), observation(), thought("again"), call(), observation(), FINAL]
    assert not post(client, two)["reward_breakdown"]["loop_detected"]["fired"]
    three = two[:-1] + [call(), observation(), FINAL]
    looped = post(client, three)
    assert looped["reward_breakdown"]["loop_detected"] == {"fired": True, "count": 1,
                                                          "points": -10.0}


def test_filters_reject_with_visible_reasons_and_still_score(env_client: Any) -> None:
    client = env_client(SEED)
    twice = [thought("Try it"), call(), observation(), thought("try  IT"), FINAL]
    assert post(client, twice)["reject_reasons"] == []
    thrice = twice[:-1] + [thought("TRY it"), FINAL]
    rejected = post(client, thrice, trace_id="rep")
    assert rejected["stage"] == "rejected"
    assert rejected["reject_reasons"] == [
        {"filter": "repeated_thought", "detail": rejected["reject_reasons"][0]["detail"],
         "step_index": 4}]
    assert rejected["reward"] == 20  # scored all the same

    streak2 = [call(), observation(error="boom"), call(), observation(error="boom"), FINAL]
    assert post(client, streak2)["stage"] != "rejected"
    streak3 = streak2[:-1] + [call(), observation(error="boom"), FINAL]
    assert post(client, streak3)["reject_reasons"][0]["filter"] == "tool_error_streak"
    # Non-zero exit codes alone are not tool errors.
    exits = [s for _ in range(4) for s in (call(), observation(exit_code=2))] + [FINAL]
    assert post(client, exits)["stage"] != "rejected"

    empty = post(client, [{"type": "action", "tool": "", "arguments": {}}, FINAL])
    assert empty["reject_reasons"][0]["filter"] == "empty_action"
    assert empty["reject_reasons"][0]["step_index"] == 0
    no_steps = post(client, [])
    assert no_steps["reject_reasons"][0]["filter"] == "empty_action"

    record = client.get("/v1/traces/rep").json()
    assert record["stage"] == "rejected" and record["reward"] == 20
    assert record["reject_reasons"][0]["filter"] == "repeated_thought"
    assert [t["trace_id"] for t in client.get("/v1/traces?stage=rejected").json()["traces"]]

    stats = client.get("/v1/stats").json()
    assert stats["rejections_by_filter"] == {"repeated_thought": 1, "tool_error_streak": 1,
                                             "empty_action": 2}
    assert stats["rule_firings"]["task_success"] == stats["traces"]
    assert sum(b["traces"] for b in stats["reward_histogram"]) == stats["traces"]
    assert {"from": 20.0, "to": 25.0, "traces": stats["reward_histogram"][-1]["traces"]} \
        in stats["reward_histogram"]


def test_long_form_and_custom_rules(env_client: Any) -> None:
    client = env_client({
        "reward_rules": {
            "invalid_tool_call": {"points": -5, "per_occurrence": True, "max_count": 2},
            "loop_detected": {"points": -10, "loop_threshold": 2},
            "tests_pass": {"points": 5, "match": {"tool": "run_tests",
                                                  "observation": r"\b\d+ passed\b"}},
            "hard_success": {"points": 7, "match": {"metadata": {"difficulty": "hard"},
                                                    "status": "success"}},
            "answered": {"points": 1, "match": {"final": "(?i)^done$"}},
        },
        "invalid_trace_filters": {"tool_error_streak": {"max_streak": 2}},
    })
    bad = [{"type": "action", "tool": "t", "arguments": "x"} for _ in range(4)]
    capped = post(client, [*bad, FINAL])
    assert capped["reward_breakdown"]["invalid_tool_call"] == {
        "fired": True, "count": 4, "points": -10.0}
    assert capped["reward_breakdown"]["loop_detected"]["fired"]  # threshold 2
    assert capped["reward_breakdown"]["answered"]["fired"]

    passing = post(client, [call("run_tests"), observation("12 passed in 0.3s"), FINAL],
                   metadata={"difficulty": "hard"})
    assert passing["reward_breakdown"]["tests_pass"]["fired"]
    assert passing["reward_breakdown"]["hard_success"]["fired"]
    assert passing["reward"] == 5 + 7 + 1
    failing = post(client, [call("run_tests"), observation("1 failed"), FINAL],
                   metadata={"difficulty": "easy"})
    assert failing["reward"] == 1

    streak = post(client, [call(), observation(error="e"), call(), observation(error="e"),
                           FINAL])
    assert streak["reject_reasons"][0]["filter"] == "tool_error_streak"


@pytest.mark.process
@pytest.mark.parametrize(
    "environment, expected",
    [
        ({"reward_rules": {"loop_detectd": -10}},
         "error: config.json: environment.reward_rules.loop_detectd: unknown rule"),
        ({"reward_rules": {"loop_detected": {"points": -1, "loop_threshold": 1}}},
         "error: config.json: environment.reward_rules.loop_detected.loop_threshold"),
        ({"invalid_trace_filters": ["tool_error_streek"]},
         "error: config.json: environment.invalid_trace_filters.tool_error_streek"),
        ({"reward_rules": {"x": {"points": 1, "match": {"final": "(a)\\1"}}}},
         "error: config.json: environment.reward_rules.x"),
    ],
)
def test_bad_rules_stop_start_up_with_one_line(
    tmp_path: Path, environment: dict[str, Any], expected: str
) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db")}, environment=environment)
    result = subprocess.run([sys.executable, "-m", "app.cli", "serve", "--config", str(config)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), result.stderr
