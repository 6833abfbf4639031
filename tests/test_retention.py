"""`atropos prune` and the worker's `retention` section, on a database a live hub fills
over HTTP: count first, delete in batches, and never a trace still on its way to
training."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from app.db.models import SCHEDULED_TASKS, TRACES
from app.db.types import utcnow
from app.durations import format_duration, parse_duration
from app.stages.retention import Criteria
from tests.support import ROOT
from tests.support.builders import native_trace
from tests.support.databases import db_execute
from tests.support.hubs import InProcessHub, write_config
from tests.support.processes import run_cli
from tests.support.waiting import wait_until

# The batches tables as the distribution stage creates them (migration 0003); made
# here when this database has none, to show that retention respects them.
BATCH_TABLES = [
    "CREATE TABLE IF NOT EXISTS batches (batch_id VARCHAR(64) PRIMARY KEY, "
    "created_at TIMESTAMP NOT NULL, updated_at TIMESTAMP NOT NULL, size INTEGER NOT NULL, "
    "target VARCHAR(16) NOT NULL, format VARCHAR(16) NOT NULL, state VARCHAR(16) NOT NULL, "
    "attempts INTEGER NOT NULL DEFAULT 0)",
    "CREATE TABLE IF NOT EXISTS batch_traces (trace_id VARCHAR(200) PRIMARY KEY "
    "REFERENCES traces (trace_id) ON DELETE CASCADE, batch_id VARCHAR(64) NOT NULL "
    "REFERENCES batches (batch_id) ON DELETE CASCADE, position INTEGER NOT NULL)",
]


def ingest(client: httpx.Client, trace_id: str, success: bool) -> float:
    outcome = {"status": "success" if success else "failure", "code_runs_ok": success}
    r = client.post("/v1/traces", json=native_trace(trace_id=trace_id, outcome=outcome))
    assert r.status_code == 202, r.text
    return float(r.json()["reward"])


def set_rows(trace_server: dict[str, Any], trace_ids: list[str], **values: Any) -> None:
    db_execute(trace_server, sa.update(TRACES).where(TRACES.c.trace_id.in_(trace_ids))
               .values(**values))


def in_batch(trace_server: dict[str, Any], trace_id: str, state: str) -> None:
    for ddl in BATCH_TABLES:
        db_execute(trace_server, ddl)
    db_execute(trace_server, "INSERT INTO batches (batch_id, created_at, updated_at, size, "
               "target, format, state, attempts) VALUES (:b, '2026-01-01 00:00:00', "
               "'2026-01-01 00:00:00', 1, 'jsonl', 'sharegpt', :state, 0)",
               b=f"batch-{trace_id}", state=state)
    db_execute(trace_server, "INSERT INTO batch_traces (trace_id, batch_id, position) "
               "VALUES (:t, :b, 0)", t=trace_id, b=f"batch-{trace_id}")


def present(client: httpx.Client, *trace_ids: str) -> set[str]:
    return {t for t in trace_ids if client.get(f"/v1/traces/{t}").status_code == 200}


ALL = ["old-1", "old-2", "old-3", "old-high", "new-low", "old-batched", "old-leased",
       "old-pending-batch", "old-delivered"]


@pytest.fixture
def aged(start_hub: Any, trace_server: dict[str, Any]) -> InProcessHub:
    """A hub (no background stages) holding traces of every kind, most 40 days old."""
    hub: InProcessHub = start_hub(trace_server, "--no-workers")
    with hub.client() as client:
        low = [ingest(client, t, success=False) for t in ALL if t != "old-high"]
        assert max(low) < 5 <= ingest(client, "old-high", success=True)
    now = utcnow()
    set_rows(trace_server, [t for t in ALL if t.startswith("old")],
             created_at=now - timedelta(days=40))
    set_rows(trace_server, ["old-batched"], stage="batched")
    set_rows(trace_server, ["old-leased"], lease_owner="w", lease_expires_at=now + timedelta(hours=1))
    in_batch(trace_server, "old-pending-batch", "pending")
    set_rows(trace_server, ["old-delivered"], stage="delivered")
    in_batch(trace_server, "old-delivered", "delivered")
    return hub


@pytest.mark.process
def test_prune_counts_then_deletes_in_batches(aged: InProcessHub, trace_server: dict[str, Any]) -> None:
    config = str(aged.config)
    dry = run_cli("prune", "--config", config, "--older-than", "30d", "--max-reward", "5",
                  "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "matching: 4 traces older than 30d, reward < 5" in dry.stdout
    assert "nothing deleted" in dry.stdout
    with aged.client() as client:
        assert present(client, *ALL) == set(ALL)

        done = run_cli("prune", "--config", config, "--older-than", "30d", "--max-reward", "5",
                       "--batch-size", "3", "--yes")
        assert done.returncode == 0, done.stderr
        assert "deleted: 4 in 2 batches" in done.stdout
        assert "deleted: 4/4 (" in done.stderr  # the progress line, without its bar in a log
        if trace_server["storage_backend"] == "sqlite":
            assert "then: VACUUM, ANALYZE" in done.stdout
        kept = {"old-high", "new-low", "old-batched", "old-leased", "old-pending-batch"}
        assert present(client, *ALL) == kept
        assert db_execute(trace_server, "SELECT trace_id FROM batch_traces") == [
            {"trace_id": "old-pending-batch"}]

        # --stage: only that stage; the protected ones stay whatever the criteria.
        staged = run_cli("prune", "--config", config, "--older-than", "30d",
                         "--stage", "compression_skipped", "--stage", "delivered", "--yes")
        assert "deleted: 1 in 1 batches" in staged.stdout, staged.stdout + staged.stderr
        assert present(client, *ALL) == kept - {"old-high"}
        refused = run_cli("prune", "--config", config, "--older-than", "1s")
        assert refused.returncode == 2 and "pass --yes" in refused.stderr  # not a terminal
        everything = run_cli("prune", "--config", config, "--older-than", "1s", "--yes")
        assert "deleted: 1 in 1 batches" in everything.stdout  # new-low
        assert present(client, *ALL) == {"old-batched", "old-leased", "old-pending-batch"}


def on_a_terminal(answer: str, *args: str) -> tuple[int, str, str]:
    """`atropos ARGS` with a terminal for stdin and stderr, answering its question with
    `answer`: the exit code, stdout, and what the terminal showed."""
    controller, terminal = os.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", *args], cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=terminal,
                                stdout=subprocess.PIPE, stderr=terminal, text=True)
        os.write(controller, f"{answer}\n".encode())  # waits in the terminal until read
        out, _ = proc.communicate(timeout=120)
        os.set_blocking(controller, False)
        shown = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(controller, 65536):
                shown += chunk
    finally:
        os.close(controller)
        os.close(terminal)
    return proc.returncode, out, shown.decode()


@pytest.mark.process
def test_prune_asks_on_a_terminal_and_shows_a_progress_bar(aged: InProcessHub) -> None:
    args = ("prune", "--config", str(aged.config), "--older-than", "30d", "--max-reward", "5",
            "--batch-size", "2")
    code, out, _ = on_a_terminal("n", *args)
    assert code == 1 and "matching: 4 traces" in out and "nothing deleted" in out
    with aged.client() as client:
        assert present(client, *ALL) == set(ALL)
        code, out, shown = on_a_terminal("y", *args)
        assert code == 0 and "delete these 4 traces? [y/N]" in out and "deleted: 4" in out
        assert f"\r[{'#' * 24}] 100% deleted: 4/4 (" in shown, shown
        assert len(present(client, *ALL)) == len(ALL) - 4


@pytest.mark.process
def test_worker_applies_retention_once_per_period(
    aged: InProcessHub, start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    aged.stop()
    # A target that never takes the batch, so that it stays pending (and protected).
    never = {"target": "http", "url": "http://127.0.0.1:9/batches"}
    # The other stages first: each stage runs in a loop of its own, and retention passes
    # over a trace that compression holds a lease on at that moment (until next period).
    settled = run_cli("worker", "--config", str(write_config(tmp_path, trace_server,
                                                                distributor=never)), "--burst")
    assert settled.returncode == 0, settled.stderr
    retention = {"older_than": "30d", "max_reward": 5, "every": "1h", "batch_size": 2}
    hub = start_hub({**trace_server, "flush_interval_seconds": 0.2}, retention=retention,
                    distributor=never)
    kept = {"old-high", "new-low", "old-batched", "old-leased", "old-pending-batch"}
    with hub.client() as client:
        wait_until(lambda: present(client, *ALL) == kept, 20, what=f"only {kept} left")
        hub.wait_for_log("retention: deleted 4 of 4 traces matching older than 30d, reward < 5")
        [task] = db_execute(trace_server, sa.select(SCHEDULED_TASKS))
        assert task["name"] == "retention" and task["last_result"]["deleted"] == 4

        # Within the period, another process (or a restart) does not run it again.
        set_rows(trace_server, ["new-low"], created_at=utcnow() - timedelta(days=40))
        burst = run_cli("worker", "--config", str(hub.config), "--burst")
        assert burst.returncode == 0, burst.stderr
        assert "retention: deleted" not in burst.stderr
        assert "new-low" in present(client, "new-low")


@pytest.mark.process
@pytest.mark.parametrize("retention, words", [
    ({"older_than": "soon"}, "retention.older_than: Value error, 'soon' is not a duration"),
    ({"older_than": "30d", "stages": ["batched"]}, "retention.stages: Value error, batched"),
    ({}, "retention.older_than: Field required"),
])
def test_retention_config_errors(tmp_path: Path, retention: dict[str, Any], words: str) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db")}, retention=retention)
    result = run_cli("serve", "--config", str(config))
    assert result.returncode == 2 and words in result.stderr, result.stderr


@pytest.mark.parametrize("text, seconds", [("45s", 45), ("90m", 5400), ("12h", 43200),
                                           ("30d", 2592000), ("2w", 1209600), ("1.5h", 5400)])
def test_durations(text: str, seconds: int) -> None:
    assert parse_duration(text).total_seconds() == seconds
    assert parse_duration(format_duration(parse_duration(text))) == parse_duration(text)


@pytest.mark.parametrize("text", ["30", "d", "-1d", "0d", "30 days", "P30D", ""])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_criteria_describe() -> None:
    from app.domain import Stage

    assert Criteria(timedelta(days=7)).describe() == "older than 1w"
    assert (Criteria(timedelta(hours=36), 5, (Stage.REJECTED, Stage.DELIVERED)).describe()
            == "older than 36h, reward < 5, stage rejected or delivered")
