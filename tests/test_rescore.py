"""`atropos rescore`: new weights reach stored traces; a second run has nothing to do
and says why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from app.db.models import BATCHES, MEMBERS, PAYLOADS, TRACES, WITH_PAYLOADS
from app.db.types import utcnow
from tests.support import ROOT
from tests.support.builders import native_trace
from tests.support.databases import db_execute
from tests.support.hubs import write_config
from tests.support.processes import run_cli
from tests.support.real_traces import SWE_AGENT, load
from tests.support.waiting import wait_until

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


def test_recompress_replaces_old_compressions_and_names_the_batches_that_hold_them(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    """Traces compressed the old way (calls removed) get the current compression; those
    already batched, or held below the reward threshold, keep their stage, and the
    summary names the batches that hold old versions."""
    [ctf] = [p for p in SWE_AGENT if p.name == "ctf_web_i_got_id_demo.traj"]
    hub = start_hub(trace_server, environment={"invalid_trace_filters": []},
                    distributor={"min_reward_threshold": -1e9, "batch_size": 100_000})
    ids = ["sent", "waiting", "below"]
    with hub.client() as client:
        for trace_id in ids:
            body = load(ctf).model_dump(mode="json", exclude_none=True,
                                        exclude={"source_format"})
            assert client.post("/v1/traces", json=body | {"trace_id": trace_id,
                                                          "format": "native"}).status_code == 202
        client.post("/v1/traces", json=native_trace(trace_id="short"))
        wait_until(lambda: all(client.get(f"/v1/traces/{t}").json()["stage"] != "accepted"
                               for t in [*ids, "short"]), timeout=60, what="compression")
    hub.stop()
    # The old way: every call and result gone from the compressed trace.
    [row] = db_execute(trace_server, sa.select(PAYLOADS.c.compressed).where(
        PAYLOADS.c.trace_id == "sent"))
    old = row["compressed"] | {"steps": [s for s in row["compressed"]["steps"]
                                         if s["type"] not in ("action", "observation")]}
    for trace_id in ids:
        db_execute(trace_server, sa.update(PAYLOADS).where(PAYLOADS.c.trace_id == trace_id)
                   .values(compressed=old))
    now = utcnow()
    db_execute(trace_server, sa.insert(BATCHES).values(
        batch_id="b-old", created_at=now, updated_at=now, size=1, target="jsonl",
        format="sharegpt", state="delivered"))
    db_execute(trace_server, sa.insert(MEMBERS).values(trace_id="sent", batch_id="b-old",
                                                       position=0))
    db_execute(trace_server, sa.update(TRACES).where(TRACES.c.trace_id == "sent")
               .values(stage="delivered"))
    db_execute(trace_server, sa.update(TRACES).where(TRACES.c.trace_id == "below")
               .values(stage="below_threshold"))

    config = write_config(tmp_path, trace_server)
    result = run_cli("recompress", "--config", str(config),
                     "--compression", str(ROOT / "compression.json.example"))
    assert result.returncode == 0, result.stderr
    assert "recompressed: 4 traces read, 3 changed, 1 unchanged" in result.stdout
    assert "compressed again: 3" in result.stdout
    assert "batches holding old versions of changed traces (1, traces in each): b-old (1)" \
        in result.stdout
    rows = db_execute(trace_server, sa.select(TRACES.c.trace_id, TRACES.c.stage,
                                              PAYLOADS.c.compressed).select_from(WITH_PAYLOADS))
    stages = {r["trace_id"]: r["stage"] for r in rows}
    assert stages == {"sent": "delivered", "waiting": "compressed", "below": "below_threshold",
                      "short": "compression_skipped"}
    original_calls = sum(1 for s in load(ctf).steps if s.type.value == "action")
    for r in rows:
        if r["trace_id"] in ids:
            assert sum(1 for s in r["compressed"]["steps"]
                       if s["type"] == "action") == original_calls
    again = run_cli("recompress", "--config", str(config),
                    "--compression", str(ROOT / "compression.json.example"))
    assert "4 traces read, 0 changed, 4 unchanged" in again.stdout, again.stdout
    assert "batches holding old versions of changed traces: none" in again.stdout
