"""A safe quickstart: the README's first command keeps every trace and batch on the
machine, and the `tinker` target, which sends batches to a training service, runs only
when a tinker.json names that service's base_url."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT
from tests.support.builders import native_trace
from tests.support.hubs import write_config
from tests.support.processes import HubProcess, run_cli
from tests.support.waiting import wait_until

README_FIRST = re.compile(r"```sh\n(.*?)\n", re.DOTALL)


def test_the_readme_starts_with_the_example_configs() -> None:
    first = README_FIRST.search((ROOT / "README.md").read_text())
    assert first is not None
    assert first[1].endswith(
        "atropos serve --config config.json.example --compression compression.json.example")
    example = json.loads((ROOT / "config.json.example").read_text())
    assert example["distributor"]["target"] == "jsonl"
    # Beside the database, in the hub's data directory.
    data_dir = Path(example["trace_server"]["db_path"]).parent
    assert Path(example["distributor"]["output_dir"]).parent == data_dir
    compression = json.loads((ROOT / "compression.json.example").read_text())
    assert compression["compression"]["strategy"] != "summarize_middle", "it calls a model"


@pytest.mark.process
def test_the_first_command_delivers_batches_to_files_in_the_data_directory(
    tmp_path: Path,
) -> None:
    # A user who has an OpenAI key in the environment: nothing must reach OpenAI.
    env = {
        "HOME": str(tmp_path),
        "OPENAI_API_KEY": "sk-test-must-not-be-used",
        "ATROPOS_TRACE_SERVER__HOST": "127.0.0.1",
        "ATROPOS_TRACE_SERVER__PORT": "0",
        "ATROPOS_DISTRIBUTOR__BATCH_SIZE": "2",
    }
    hub = HubProcess(Path("config.json.example"), "--compression", "compression.json.example",
                     env=env).start()
    try:
        with hub.client() as client:
            for n in range(2):
                r = client.post("/v1/traces", json=native_trace(trace_id=f"q{n}"))
                assert r.status_code == 202 and r.json()["reward"] >= 5, r.text
            manifest = tmp_path / ".atropos" / "batches" / "manifest.jsonl"
            wait_until(manifest.exists, what="the batch file")
            [batch] = client.get("/v1/batches").json()["batches"]
            assert batch["target"] == "jsonl"
    finally:
        hub.stop()
    [entry] = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert entry["trace_ids"] == ["q0", "q1"]
    assert (manifest.parent / entry["file"]).is_file()
    assert (tmp_path / ".atropos" / "traces.db").is_file()


def _tinker_config(tmp_path: Path) -> Path:
    return write_config(tmp_path, {"db_path": str(tmp_path / "t.db")},
                        distributor={"target": "tinker"})


@pytest.mark.process
@pytest.mark.parametrize("command", ["serve", "worker"])
@pytest.mark.parametrize("tinker", [None, {"tinker": {"model_id": "m"}}],
                         ids=["no --tinker", "no base_url"])
def test_tinker_without_a_named_base_url_stops_with_one_line(
    tmp_path: Path, command: str, tinker: dict[str, Any] | None
) -> None:
    args = [command, "--config", str(_tinker_config(tmp_path))]
    if tinker is not None:
        path = tmp_path / "tinker.json"
        path.write_text(json.dumps(tinker))
        args += ["--tinker", str(path)]
    result = run_cli(*args, env={"OPENAI_API_KEY": "sk-test-must-not-be-used"})
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: config-") and "distributor.target is tinker" in line
    assert "--tinker FILE" in line and "tinker.base_url" in line
    assert not (tmp_path / "t.db").exists(), "stopped before opening the database"


@pytest.mark.process
def test_the_api_alone_delivers_nothing_and_needs_no_tinker_json(tmp_path: Path) -> None:
    hub = HubProcess(_tinker_config(tmp_path), "--no-workers").start()
    assert hub.stop() == 0


@pytest.mark.process
def test_tinker_with_a_named_base_url_starts(tmp_path: Path) -> None:
    tinker = tmp_path / "tinker.json"
    # A port nothing listens on: starting must not need the service.
    tinker.write_text(json.dumps({"tinker": {"base_url": "http://127.0.0.1:9/v1"}}))
    hub = HubProcess(_tinker_config(tmp_path), "--tinker", str(tinker)).start()
    assert hub.stop() == 0
