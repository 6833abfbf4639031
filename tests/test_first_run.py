"""What a new user meets first: `atropos --help` and `--version` without the hub
imported, config files found where a user keeps them, `atropos init`, the example
config bound to this machine, a port in use said in one line before anything is
created, Ctrl-C while `serve` starts, and what `atropos import` says and stores."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.api.server import exposure
from app.cli.init import files
from app.config import HubConfig, load_compression, load_config, load_tinker
from tests.support import REAL, ROOT
from tests.support.hubs import write_config
from tests.support.processes import HubProcess, run_cli
from tests.support.waiting import wait_until
from tests.test_operator import ctrl_c, stored_traces


def atropos(*args: str, cwd: Path, home: Path) -> subprocess.CompletedProcess[str]:
    """`atropos ARGS` run from `cwd`, with `home` as the user's home directory."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args], cwd=cwd, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(home)}, timeout=120,
        check=False,
    )


# --- a CLI that starts at once ------------------------------------------------------


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["export", "--help"]])
def test_help_and_version_do_not_import_the_hub(args: list[str]) -> None:
    """What made `atropos --help` take seconds: the whole hub imported first. A
    command's own --help imports its module, and nothing of the server."""
    hub = ", 'app.hub', 'app.ingest.ingestor', 'sqlalchemy'" if args[0].startswith("-") else ""
    probe = (
        "import sys\n"
        "from app.cli import main\n"
        "try:\n"
        f"    main({args!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        f"heavy = {{'uvicorn', 'fastapi', 'app.api.app'{hub}}}\n"
        "print(sorted(heavy & set(sys.modules)), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.stderr.strip().splitlines()[-1] == "[]", done.stderr
    if args == ["--version"]:
        assert done.stdout.startswith("atropos-hub "), done.stdout
    else:
        assert "example:" in done.stdout


def test_help_lists_every_command_a_module_declares() -> None:
    """`atropos --help` lists the commands from a table, without importing them: the
    table holds every command the modules declare, each in its own module."""
    from app.cli.main import build_parser
    from app.cli.options import COMMANDS

    def names(parser: argparse.ArgumentParser) -> set[str]:
        [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return set(sub.choices)

    assert names(build_parser()) == names(build_parser(["--help"])) == set(COMMANDS)
    for name, (module, _) in COMMANDS.items():
        assert name in names(build_parser([name])), (name, module)


def test_config_files_are_found_where_a_user_keeps_them(tmp_path: Path) -> None:
    """--config defaults to ./config.json, then ~/.atropos/config.json, then the
    built-in defaults (whose database is under the home directory)."""
    home, here = tmp_path / "home", tmp_path / "work"
    here.mkdir(parents=True)
    (home / ".atropos").mkdir(parents=True)

    defaults = atropos("db", "upgrade", cwd=here, home=home)
    assert defaults.returncode == 0, defaults.stderr
    assert (home / ".atropos" / "traces.db").exists()

    (home / ".atropos" / "config.json").write_text(json.dumps(
        {"trace_server": {"db_path": str(tmp_path / "from-home.db")}}))
    assert atropos("db", "upgrade", cwd=here, home=home).returncode == 0
    assert (tmp_path / "from-home.db").exists()

    (here / "config.json").write_text(json.dumps(
        {"trace_server": {"db_path": str(tmp_path / "from-here.db")}}))
    assert atropos("db", "upgrade", cwd=here, home=home).returncode == 0
    assert (tmp_path / "from-here.db").exists()

    # A file found by default is checked as one named would be.
    (here / "config.json").write_text('{"trace_server": {"port": "eighty"}}')
    broken = atropos("db", "upgrade", cwd=here, home=home)
    assert broken.returncode == 2
    assert broken.stderr.startswith("error: config.json: trace_server.port"), broken.stderr


def test_init_writes_every_key_and_the_examples_show_them(tmp_path: Path) -> None:
    home = tmp_path / "home"
    written = atropos("init", cwd=tmp_path, home=home)
    assert written.returncode == 0, written.stderr
    assert written.stdout.splitlines()[-1] == "next: atropos serve"
    expected = files()
    for name, content in expected.items():
        on_disk = json.loads((tmp_path / name).read_text())
        assert keys(on_disk) == keys(content), name
        # What init writes is what the hub reads when there is no file at all.
        assert "~" in json.dumps(on_disk) or name == "compression.json"
    assert load_config(tmp_path / "config.json") == HubConfig()
    load_compression(tmp_path / "compression.json")
    assert load_tinker(tmp_path / "tinker.json").tinker.model_id == \
        expected["tinker.json"]["tinker"]["model_id"]
    again = atropos("init", cwd=tmp_path, home=home)
    assert again.returncode == 2 and "--force" in again.stderr

    for name, content in expected.items():
        example = json.loads((ROOT / f"{name}.example").read_text())
        missing = keys(content) - keys(example)
        assert not missing, f"{name}.example does not show {sorted(missing)}"
    tinker = load_tinker(ROOT / "tinker.json.example").tinker
    # A base URL and a model that work together: the model is the one init names for
    # the default base URL.
    assert (tinker.base_url, tinker.model_id) == (
        "https://api.openai.com/v1", expected["tinker.json"]["tinker"]["model_id"])


def keys(obj: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for key, value in obj.items():
        out.add(prefix + key)
        if isinstance(value, dict):
            out |= keys(value, f"{prefix}{key}.")
    return out


# --- safe defaults ------------------------------------------------------------------


def test_the_example_config_listens_on_this_machine_only() -> None:
    example = load_config(ROOT / "config.json.example")
    assert example.trace_server.host == "127.0.0.1"
    assert exposure(example) is None
    assert HubConfig().trace_server.host == "127.0.0.1"  # the built-in default too


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
def test_loopback_is_not_exposed(host: str) -> None:
    assert exposure(HubConfig.model_validate({"trace_server": {"host": host}})) is None


def test_every_interface_with_auth_off_says_what_is_exposed() -> None:
    open_hub = HubConfig.model_validate({"trace_server": {"host": "0.0.0.0"}})
    warning = exposure(open_hub)
    assert warning is not None
    assert "0.0.0.0" in warning and "auth off" in warning
    assert "127.0.0.1" in warning and "auth.enabled" in warning  # the two ways to close it
    assert exposure(HubConfig.model_validate(
        {"trace_server": {"host": "0.0.0.0"}, "auth": {"enabled": True}})) is None


@pytest.mark.process
def test_an_exposed_hub_starts_and_warns_once(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db"), "host": "0.0.0.0"})
    hub = HubProcess(config).start(timeout=120)
    try:
        port = hub.url.rsplit(":", 1)[1]
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            assert client.get("/healthz").status_code == 200
        warnings = [line for line in hub.lines if " WARNING " in line and "auth off" in line]
        assert len(warnings) == 1, hub.log
    finally:
        assert hub.stop() == 0


@pytest.mark.process
def test_a_port_in_use_is_one_line_before_anything_is_made(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write_config(tmp_path, {"db_path": str(db), "port": port})
        done = run_cli("serve", "--config", str(config))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: port {port} on 127.0.0.1 is in use"), lines[0]
    assert "trace_server.port" in lines[0] and "ATROPOS_TRACE_SERVER__PORT" in lines[0]
    assert not db.exists()  # nothing made: no database, no migration


@pytest.mark.process
def test_ctrl_c_while_serve_starts_exits_130_without_a_traceback(tmp_path: Path) -> None:
    """Ctrl-C while the database is made and the ingest processes start (the fork
    server among them, which the terminal signals too)."""
    db = tmp_path / "t.db"
    config = str(write_config(tmp_path, {"db_path": str(db)}))
    stopped = ctrl_c("serve", "--config", config, when=db.exists)
    assert stopped.returncode == 130, stopped.stderr
    assert "Traceback" not in stopped.stderr, stopped.stderr


# --- import -------------------------------------------------------------------------


def test_import_says_what_it_read_and_fails_when_nothing_could_be(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db")})
    junk = tmp_path / "junk.jsonl"
    junk.write_text("not json\n{\"neither\": \"a trajectory\"}\nnot json either\n")
    done = run_cli("import", "--config", str(config), str(junk))
    assert done.returncode == 1
    first, *details = done.stdout.splitlines()
    assert first == "read 3, stored 0, duplicates 0, rejected 0, refused 0, unreadable 3"
    # Grouped by reason, with where to look.
    assert len(details) == 2, done.stdout
    assert details[0].startswith("  unreadable 2: invalid JSON"), details
    assert "junk.jsonl:1, " in details[0] and "junk.jsonl:3)" in details[0]
    assert "nothing could be read" in done.stderr


@pytest.mark.process
def test_an_import_into_a_running_hubs_database_moves_on_at_once(tmp_path: Path) -> None:
    """Traces written into the database by another process are picked up by the hub's
    stages without a wake-up: well before flush_interval_seconds."""
    db = tmp_path / "t.db"
    config = write_config(tmp_path, {"db_path": str(db), "flush_interval_seconds": 3600})
    hub = HubProcess(config).start(timeout=120)
    try:
        tau = REAL / "tau-bench" / "gpt-4o-airline.json"
        done = run_cli("import", "--config", str(config), str(tau))
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("read 200, stored 200, duplicates 0, "), done.stdout

        def waiting() -> int:
            with sqlite3.connect(db) as conn:
                return int(conn.execute(
                    "SELECT count(*) FROM traces WHERE stage = 'accepted'").fetchone()[0])

        wait_until(lambda: waiting() == 0, timeout=60, what="the imported traces to move on")
        with hub.client() as client:
            page = client.get("/v1/traces", params={"env": "airline", "model": "gpt-4o",
                                                    "limit": 200}).json()["traces"]
        # Where they came from: the source's format, its domain and model.
        assert len(page) == 200
        assert {(t["format"], t["env"], t["model"]) for t in page} == {
            ("tau_bench", "airline", "gpt-4o")}
    finally:
        hub.stop()
    assert stored_traces(db) == 200


# --- the dashboard with auth off ----------------------------------------------------


def test_with_auth_off_no_page_speaks_of_keys(start_hub: Any, trace_server: dict[str, Any],
                                              tmp_path: Path) -> None:
    from tests.support.pipeline import ingest

    hub = start_hub(trace_server, distributor={"batch_size": 1, "min_reward_threshold": 0,
                                               "output_dir": str(tmp_path / "batches")})
    with hub.client() as client:
        ingest(client, ["t0"])
        batches = wait_until(lambda: client.get("/v1/batches").json()["batches"], timeout=60,
                             what="a batch")
        pages = ["/ui", "/ui/traces", "/ui/traces/t0", "/ui/review", "/ui/batches",
                 f"/ui/batches/{batches[0]['batch_id']}", "/ui/runs", "/ui/atropos"]
        for page in pages:
            r = client.get(page, follow_redirects=True)
            assert r.status_code == 200, page
            text = re.sub(r"<[^>]+>", " ", r.text).lower()
            assert not re.search(r"\b(api key|admin key|sign in|keys?\b)", text), page


# --- logs ---------------------------------------------------------------------------


@pytest.mark.process
def test_refused_requests_are_one_line_per_client_and_status_per_interval(
    start_hub_process: Any, tmp_path: Path
) -> None:
    hub = start_hub_process({"db_path": str(tmp_path / "t.db"), "log_summary_seconds": 2})
    with hub.client() as client:
        for _ in range(20):
            assert client.get("/v1/traces/nope").status_code == 404
        assert client.post("/v1/traces", content=b"{not json").status_code == 400

    def counted() -> int:
        said = [line for line in hub.lines if "answered 404 to 127.0.0.1" in line]
        assert all(" INFO atropos.http: " in line for line in said), hub.log
        return sum(int(m[1]) if (m := re.search(r": (\d+) more in", line)) else 1
                   for line in said)

    def the_400s() -> int:
        return sum("answered 400 to 127.0.0.1;" in line for line in hub.lines)

    # The log is read as it comes: the 400's line may come after the last 404's.
    wait_until(lambda: counted() == 20 and the_400s() > 0, timeout=30,
               what="every 404 counted and the 400 said")
    # Not a line per request: at most two an interval (the first, then the count).
    assert sum("answered 404" in line for line in hub.lines) < 20, hub.log
    assert the_400s() == 1
    # uvicorn's narration of its start is not at INFO: one "listening" line.
    assert sum("listening" in line.lower() or "running on" in line.lower()
               for line in hub.lines) == 1, hub.log
    assert not any("uvicorn" in line for line in hub.lines), hub.log
