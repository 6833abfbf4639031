"""`atropos rescore`: new weights reach stored traces; a second run has nothing to do
and says why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.builders import native_trace
from tests.support.hubs import write_config
from tests.support.processes import run_cli

pytestmark = pytest.mark.process


def test_rescore_applies_new_rules_and_filters(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    hub = start_hub(trace_server, "--no-workers")
    streak = [{"type": "action", "tool": "t", "arguments": {}},
              {"type": "observation", "content": "x", "error": "boom"}] * 3
    with hub.client() as client:
        client.post("/v1/traces", json=native_trace(trace_id="good"))
        client.post("/v1/traces", json=native_trace(trace_id="bad", steps=streak))
        assert client.get("/v1/traces/bad").json()["stage"] == "rejected"
        assert client.get("/v1/traces/good").json()["reward"] == 30
    hub.stop()

    config = write_config(tmp_path, trace_server, environment={
        "reward_rules": {"task_success": 100}, "invalid_trace_filters": []})
    result = run_cli("rescore", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert "rescored: 2" in result.stdout
    assert "stage rejected->accepted: 1" in result.stdout
    again = run_cli("rescore", "--config", str(config))
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("nothing to rescore: all 2 traces are already scored with "
                                   "the current reward rules and filters")
    recent = run_cli("rescore", "--config", str(config), "--since", "2099-01-01")
    assert recent.stdout.startswith("nothing to rescore: no traces stored since 2099-01-01")

    hub.start()
    with hub.client() as client:
        good = client.get("/v1/traces/good").json()
        bad = client.get("/v1/traces/bad").json()
    assert good["reward"] == 100
    assert set(good["reward_breakdown"]) == {"task_success", "env_reward"}
    assert bad["stage"] == "accepted" and bad["reject_reasons"] == []
