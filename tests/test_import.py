"""`atropos import` over the whole real corpus (../shared/fixtures/real), checked
against the facts SOURCES.md states."""

from __future__ import annotations

import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support import REAL
from tests.support.hubs import write_config
from tests.support.processes import run_cli


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=300)


def summary(stdout: str) -> dict[str, str]:
    """The counts of the first line (`read N, stored M, ...`) and the detail lines
    (`  rejected by filter: ...`) by name."""
    first, *details = stdout.splitlines()
    counts = dict(part.rsplit(" ", 1) for part in first.split(", "))
    return counts | dict(line.strip().split(": ", 1) for line in details if ": " in line)


@pytest.mark.process
@pytest.mark.corpus
def test_the_whole_corpus_is_stored_or_reported(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    config = write_config(tmp_path, {"db_path": str(db)})
    result = run("import", "--config", str(config), str(REAL))
    assert result.returncode == 0, result.stderr
    counts = summary(result.stdout)
    stored, unreadable = int(counts["stored"]), int(counts["unreadable"])
    assert stored + unreadable == int(counts["read"]) == 930 and stored >= 900
    # The unreadable ones are the failed Gemini runs with no history: one reason, with
    # its count and where to look.
    reasons = [line for line in result.stdout.splitlines() if line.startswith("  unreadable ")]
    assert len(reasons) == 1 and reasons[0].startswith(f"  unreadable {unreadable}: "), reasons
    assert "gemini-2.0_error.jsonl" in reasons[0] and "no history" in reasons[0]
    assert "imported: 930" in result.stderr

    with sqlite3.connect(db) as conn:
        def one(sql: str) -> Any:
            return conn.execute(sql).fetchone()[0]

        origin = ("(SELECT json_extract(p.trace, '$.metadata.imported_from.location') "
                  "FROM trace_payloads AS p WHERE p.trace_id = traces.trace_id)")
        # tau-bench's reward is the environment's: its own column, no status made of it.
        assert one(f"SELECT count(*) FROM traces WHERE {origin} LIKE '%tau-bench%' "
                   "AND env_reward = 1 AND status = 'unknown'") == 84
        # Where each came from: the source's own format, and its env and model.
        assert conn.execute(f"SELECT DISTINCT source_format, env, model FROM traces "
                            f"WHERE {origin} LIKE '%tau-bench%'").fetchall() == [
            ("tau_bench", "airline", "gpt-4o")]
        assert one("SELECT count(*) FROM traces WHERE source_format = 'native'") == 0
        # The KnowAgent run that repeats one action 46 times (line 4) loops.
        assert one(f"SELECT json_extract(reward_breakdown, '$.loop_detected.fired') FROM traces "
                   f"WHERE {origin} LIKE '%KnowAgent%:4'") == 1
        # The OpenHands run that hit its iteration limit is a timeout.
        assert one(f"SELECT status FROM traces WHERE {origin} LIKE '%ponyc-4588%'") == "timeout"
        assert one(f"SELECT json_extract(reward_breakdown, '$.timeout.fired') FROM traces "
                   f"WHERE {origin} LIKE '%ponyc-4588%'") == 1
        rejected = one("SELECT count(*) FROM traces WHERE stage = 'rejected'")
    assert rejected > 0 and "tool_error_streak" in counts["rejected by filter"]

    again = run("import", "--config", str(config), str(REAL))
    assert summary(again.stdout)["duplicates"] == str(stored)
    assert summary(again.stdout)["stored"] == "0"
    strict = run("import", "--config", str(config), "--strict", str(REAL / "agentbench-medagentbench"))
    assert strict.returncode == 1


@pytest.mark.process
def test_import_through_a_running_hub(start_hub: Any, trace_server: dict[str, Any],
                                      tmp_path: Path) -> None:
    hub = start_hub(trace_server, "--no-workers", listen=True)  # `import --url`: a socket
    config = write_config(tmp_path, trace_server)
    result = run("import", "--config", str(config), "--url", hub.url, str(REAL / "tau-bench"))
    assert result.returncode == 0, result.stderr
    assert summary(result.stdout)["stored"] == "200"
    with hub.client() as client:
        stats = client.get("/v1/stats").json()
        assert stats["traces"] == 200 and stats["by_status"] == {"unknown": 200}
        env_reward = stats["env_reward"]
        assert (env_reward["traces"], env_reward["mean"]) == (200, 84 / 200)
        # The 84 runs tau-bench scored 1 are those whose reward reaches the threshold.
        assert (env_reward["passing"], env_reward["passing_share"]) == (84, 84 / 200)


@pytest.mark.process
def test_unknown_format_name_is_one_line(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db")})
    result = run("import", "--config", str(config), "--format", "klingon", str(REAL))
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: --format klingon: unknown")
