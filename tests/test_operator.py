"""What an operator meets at the command line: every failure one line
saying what failed and what to do, exit 2 for configuration and environment problems,
the traceback only with --debug; typos refused; the log's level and format."""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shlex
import signal
import socket
import sqlite3
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.db import engine as db_engine
from tests.support import REAL, ROOT
from tests.support.builders import native_trace
from tests.support.databases import (
    PG_ADMIN_URL,
    allow_pg_connections,
    create_pg_database,
    drop_pg_database,
)
from tests.support.hubs import write_config
from tests.support.processes import run_cli
from tests.support.waiting import wait_until

PASSWORD = "s3cret-pw"


def one_line_error(result: Any) -> str:
    """The command failed with exit 2 and a single `error:` line (after at most the
    INFO line naming the database), and that line."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    assert PASSWORD not in result.stderr + result.stdout
    return str(errors[0])


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def postgres_at(tmp_path: Path, url: str) -> Path:
    return write_config(tmp_path, {"storage_backend": "postgresql", "database_url": url})


@pytest.mark.process
def test_postgresql_unreachable_is_one_line_without_the_password(tmp_path: Path) -> None:
    port = free_port()
    config = postgres_at(tmp_path, f"postgresql://hub:{PASSWORD}@127.0.0.1:{port}/atropos")
    line = one_line_error(run_cli("db", "upgrade", "--config", str(config)))
    assert f"cannot reach PostgreSQL at 127.0.0.1:{port} (connection refused)" in line
    assert "trace_server.database_url" in line


@pytest.mark.process
@pytest.mark.parametrize(
    ("url", "said"),
    [
        (f"mysql://hub:{PASSWORD}@db.example/atropos", "mysql:// is not supported"),
        ("not-a-url", "not a database URL"),
    ],
)
def test_a_database_url_that_is_not_postgresql_is_one_line(
    tmp_path: Path, url: str, said: str
) -> None:
    line = one_line_error(run_cli("db", "upgrade", "--config", str(postgres_at(tmp_path, url))))
    assert "trace_server.database_url" in line and said in line


@pytest.mark.process
def test_db_path_that_is_a_directory_is_one_line(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path)})
    line = one_line_error(run_cli("db", "upgrade", "--config", str(config)))
    assert f"trace_server.db_path: {tmp_path} is a directory" in line


@pytest.mark.process
def test_db_path_where_no_file_can_be_made_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    db_path = tmp_path / "a-file" / "traces.db"  # its "directory" is a file
    config = write_config(tmp_path, {"db_path": str(db_path)})
    line = one_line_error(run_cli("db", "upgrade", "--config", str(config)))
    assert f"cannot open the SQLite database {db_path}" in line
    assert "trace_server.db_path" in line


@pytest.mark.process
def test_debug_shows_the_traceback_behind_the_line(tmp_path: Path) -> None:
    config = postgres_at(tmp_path, f"postgresql://hub:{PASSWORD}@127.0.0.1:{free_port()}/x")
    for result in (
        run_cli("db", "upgrade", "--config", str(config), "--debug"),
        run_cli("db", "upgrade", "--config", str(config), env={"ATROPOS_DEBUG": "1"}),
    ):
        assert result.returncode == 2
        assert "Traceback" in result.stderr and "ConnectionRefusedError" in result.stderr
        assert result.stderr.rstrip().splitlines()[-1].startswith("error: cannot reach")


@pytest.mark.process
def test_export_into_a_missing_directory_is_one_line(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db")})
    out = tmp_path / "nowhere" / "out.jsonl"
    line = one_line_error(
        run_cli("export", "--config", str(config), "--format", "native", "-o", str(out))
    )
    assert f"the directory {out.parent} does not exist" in line


@pytest.mark.process
def test_import_to_a_hub_that_is_not_running_is_one_line(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db")})
    url = f"http://127.0.0.1:{free_port()}"
    line = one_line_error(
        run_cli("import", "--config", str(config), "--url", url, str(REAL / "tau-bench"))
    )
    assert f"cannot reach the hub at {url}" in line and "atropos serve" in line


@pytest.mark.process
def test_import_of_a_missing_path_names_it(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db")})
    missing = tmp_path / "no-such-run.jsonl"
    line = one_line_error(run_cli("import", "--config", str(config), str(missing)))
    assert str(missing) in line


# --- logs ---------------------------------------------------------------------------


@pytest.mark.process
def test_log_level_and_json_format(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db")})
    quiet = run_cli("db", "upgrade", "--config", str(config), "--log-level", "warning")
    assert quiet.returncode == 0 and quiet.stderr == ""

    shipped = run_cli("db", "upgrade", "--config", str(config), "--log-format", "json")
    assert shipped.returncode == 0, shipped.stderr
    lines = [json.loads(line) for line in shipped.stderr.splitlines()]
    assert lines and all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    assert any(line["message"].startswith("database sqlite") for line in lines)


@pytest.mark.process
def test_log_level_from_the_config_file(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db"), "log_level": "ERROR"})
    result = run_cli("db", "upgrade", "--config", str(config))
    assert result.returncode == 0 and result.stderr == ""


# --- typos are errors -------------------------------------------------------------------


@pytest.mark.process
def test_an_override_naming_no_section_stops_start_up(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db")})
    result = run_cli("db", "upgrade", "--config", str(config),
                     env={"ATROPOS_TRACE_SRV__PORT": "9000"})
    line = one_line_error(result)
    assert "environment variable ATROPOS_TRACE_SRV__PORT: no config section 'trace_srv'" in line
    assert not (tmp_path / "t.db").exists()  # stopped before the database


@pytest.mark.process
def test_a_bad_override_is_blamed_on_the_variable(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db")})
    typo = one_line_error(run_cli("db", "upgrade", "--config", str(config),
                                  env={"ATROPOS_TRACE_SERVER__PROT": "9000"}))
    assert typo.startswith("error: environment variable ATROPOS_TRACE_SERVER__PROT: "
                           "trace_server.prot: unknown key")
    bad = one_line_error(run_cli("db", "upgrade", "--config", str(config),
                                 env={"ATROPOS_AUTH__ENABLED": "yes"}))
    assert bad.startswith("error: environment variable ATROPOS_AUTH__ENABLED: auth.enabled:")


def test_an_override_read_as_json_except_for_text_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.config import load_config

    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db")})
    monkeypatch.setenv("ATROPOS_TRACE_SERVER__PORT", "9000")
    monkeypatch.setenv("ATROPOS_AUTH__ENABLED", "true")
    monkeypatch.setenv("ATROPOS_TRACE_SERVER__HOST", "1234")  # text, although it parses
    loaded = load_config(config)
    assert loaded.trace_server.port == 9000 and loaded.auth.enabled is True
    assert loaded.trace_server.host == "1234"


@pytest.mark.process
@pytest.mark.parametrize(
    ("section", "key", "value"),
    [("distributor", "batch_size", "32"), ("auth", "enabled", "yes"),
     ("trace_server", "port", 80.5)],
)
def test_config_files_are_strict_about_types(
    tmp_path: Path, section: str, key: str, value: Any
) -> None:
    config = tmp_path / "config.json"
    sections: dict[str, Any] = {"trace_server": {"db_path": str(tmp_path / "t.db")}}
    sections.setdefault(section, {})[key] = value
    config.write_text(json.dumps(sections))
    line = one_line_error(run_cli("db", "upgrade", "--config", str(config)))
    assert f"config.json: {section}.{key}: " in line and json.dumps(value) in line


def test_a_query_value_outside_its_set_is_422_listing_the_valid_ones(client: Any) -> None:
    response = client.get("/v1/traces", params={"stage": "reject"})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["field"] == "stage" and "'rejected'" in error["message"]
    assert client.get("/v1/traces", params={"status": "great"}).status_code == 422
    assert client.get("/v1/traces", params={"stage": "rejected"}).status_code == 200


# --- commands that do not surprise ---------------------------------------------------


@pytest.mark.process
def test_batches_list_and_retry_arguments(tmp_path: Path) -> None:
    config = str(write_config(tmp_path, {"db_path": str(tmp_path / "t.db")}))
    empty = run_cli("batches", "list", "--state", "failed", "--config", config)
    assert empty.returncode == 0 and empty.stdout == "no batches failed\n"
    none = run_cli("batches", "retry", "--all-failed", "--config", config)
    assert none.returncode == 0 and none.stdout.startswith("0 failed batches")
    both = run_cli("batches", "retry", "b-1", "--all-failed", "--config", config)
    assert one_line_error(both) == "error: batches retry: name one BATCH_ID or pass --all-failed"
    wrong = run_cli("batches", "list", "--state", "lost", "--config", config)
    assert wrong.returncode == 2 and "invalid choice: 'lost'" in wrong.stderr


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("atropos",)
              ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser of the `atropos` command, with the words that reach it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def test_every_help_ends_with_an_example_that_parses() -> None:
    from app.cli.main import build_parser

    top = build_parser()
    seen = []
    for path, parser in _commands(top):
        *_, label, example = parser.format_help().rstrip().splitlines()
        assert label == "example:", f"{' '.join(path)} --help ends with {example!r}"
        words = shlex.split(example)
        assert tuple(words[: len(path)]) == path, f"{example!r} is not `{' '.join(path)} ...`"
        top.parse_args(words[1:])  # exits (SystemExit) if the example does not parse
        seen.append(" ".join(path[1:]))
    assert {"serve", "worker", "import", "export", "prune", "batches list", "db upgrade",
            "keys create", "run", "train", "doctor", "rescore"} <= set(seen)


def _commands_the_hub_prints() -> dict[str, str]:
    """Each `atropos ...` command that the hub's messages (its string literals, not
    docstrings) and dashboard pages tell a user to run, with its options: -> where."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "app").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                           ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docstrings):
                for command in re.findall(r"`(atropos [^`]* --[^`]*)`", node.value):
                    found[command] = f"{path.relative_to(ROOT)}:{node.lineno}"
    for page in sorted((ROOT / "app" / "api" / "ui" / "templates").glob("*.html")):
        for command in re.findall(r"<code>(atropos [^<]* --[^<]*)</code>", page.read_text()):
            found[command] = str(page.relative_to(ROOT))
    return found


def test_every_command_the_hub_tells_a_user_to_run_parses_as_printed() -> None:
    from app.cli.main import build_parser

    top = build_parser()
    commands = _commands_the_hub_prints()
    assert "atropos keys create --scope admin --name admin" in commands  # the scan works
    for command, where in commands.items():
        words = shlex.split(re.sub(r"%[sdr]|\{[^}]*\}", "ID", command))
        try:
            top.parse_args(words[1:])
        except SystemExit:
            raise AssertionError(f"{where}: `{command}` does not run as printed") from None


# --- logs a person can read -------------------------------------------------------------


@pytest.mark.process
@pytest.mark.parametrize("path", ["/v1/traces", "/scored_data"])
def test_a_client_gone_mid_body_is_one_info_line(
    start_hub_process: Any, tmp_path: Path, path: str
) -> None:
    hub = start_hub_process({"db_path": str(tmp_path / "t.db")})
    host, port = hub.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     "Content-Length: 100000\r\n\r\n".encode() + b'{"messages": [')
    hub.wait_for_log("the body stopped before its end")
    with hub.client() as client:  # the hub serves on; what it logged for the request is in
        assert client.get("/healthz").status_code == 200
    said = [line for line in hub.lines if path in line]
    assert len(said) == 1 and " INFO " in said[0], hub.log
    assert "Traceback" not in hub.log and " ERROR " not in hub.log


def stored_traces(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        try:
            return int(conn.execute("SELECT count(*) FROM traces").fetchone()[0])
        except sqlite3.OperationalError:  # not migrated yet
            return 0


def ctrl_c(*args: str, when: Callable[[], object]) -> subprocess.CompletedProcess[str]:
    """`atropos ARGS`, sent a terminal's Ctrl-C (SIGINT to its process group) once
    `when()` holds."""
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", *args], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        wait_until(lambda: when() or proc.poll() is not None, timeout=120, what="the moment")
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.process
def test_ctrl_c_on_import_then_export(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    config = str(write_config(tmp_path, {"db_path": str(db)}))
    many = tmp_path / "many.jsonl"
    with many.open("w") as f:
        for n in range(20_000):
            f.write(json.dumps(native_trace(trace_id=f"t-{n}", task=f"task {n}")) + "\n")

    imported = ctrl_c("import", "--config", config, str(many),
                      when=lambda: stored_traces(db) >= 3000)
    assert imported.returncode == 130, imported.stderr
    assert "Traceback" not in imported.stderr
    stored = stored_traces(db)
    assert 3000 <= stored < 20_000
    # What the summary says is stored is what the database holds.
    assert imported.stdout.startswith(f"read {stored}, stored {stored}, duplicates 0,"), \
        imported.stdout
    assert "interrupted (Ctrl-C)" in imported.stdout

    out = tmp_path / "exports"
    out.mkdir()
    exported = ctrl_c("export", "--config", config, "--format", "openai",
                      "-o", str(out / "train.jsonl"), when=lambda: any(out.iterdir()))
    assert exported.returncode == 130, exported.stderr
    assert "Traceback" not in exported.stderr
    assert list(out.iterdir()) == []  # neither the temporary file nor a partial export


@pytest.mark.skipif(not PG_ADMIN_URL, reason="no PostgreSQL: set ATROPOS_TEST_DATABASE_URL")
@pytest.mark.parametrize("dialect", ["postgresql"])
def test_connections_dropped_while_idle_cost_no_request(
    start_hub: Any, trace_server: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL restarted while the hub sat idle: its pooled connections are gone.
    A connection idle for IDLE_BEFORE_PING_SECONDS (here: any) is pinged before use
    and replaced, so the next requests are answered as before, none with 503."""
    monkeypatch.setattr(db_engine, "IDLE_BEFORE_PING_SECONDS", 0.0)
    hub = start_hub(trace_server, "--no-workers")  # the requests alone use the pool
    with hub.client() as client:
        assert client.post("/v1/traces", json=native_trace(trace_id="before")).status_code == 202
        allow_pg_connections(trace_server["database_url"], False)  # cut every connection
        allow_pg_connections(trace_server["database_url"], True)
        assert client.post("/v1/traces", json=native_trace(trace_id="after")).status_code == 202
        assert [t["trace_id"] for t in client.get("/v1/traces").json()["traces"]] == [
            "after", "before"
        ]


@pytest.mark.process
@pytest.mark.skipif(not PG_ADMIN_URL, reason="no PostgreSQL: set ATROPOS_TEST_DATABASE_URL")
def test_a_database_lost_while_serving_is_said_once_per_kind_and_its_return(
    start_hub_process: Any,
) -> None:
    url = create_pg_database()
    try:
        hub = start_hub_process({"storage_backend": "postgresql", "database_url": url,
                                 "flush_interval_seconds": 0.2})
        with hub.client() as client:
            assert client.post("/v1/traces", json=native_trace(trace_id="before")).status_code == 202
            allow_pg_connections(url, False)
            for n in range(20):
                refused = client.post("/v1/traces", json=native_trace(trace_id=f"during-{n}"))
                assert refused.status_code == 503 and "retry-after" in refused.headers
                assert client.get("/v1/traces").status_code == 503
            hub.wait_for_log("the database is failing")
            allow_pg_connections(url, True)
            wait_until(lambda: client.post("/v1/traces", json=native_trace(trace_id="after"))
                       .status_code == 202, timeout=30, what="writes again")
            hub.wait_for_log("the database works again")
        failing = [line for line in hub.lines if "the database is failing" in line]
        kinds = [line.split("the database is failing (")[1].split(",")[0] for line in failing]
        assert len(kinds) == len(set(kinds)) < 5, hub.log  # per kind, not per request
        assert all(" ERROR atropos.database: " in line for line in failing)
        # Each return is said once; on a loaded machine the outage may flap (a pooled
        # connection fails after another worked), each flap with its own kind.
        assert 1 <= sum("the database works again" in line for line in hub.lines) <= len(kinds)
        assert "Traceback" not in hub.log and len(hub.lines) < 30, hub.log
    finally:
        drop_pg_database(url)


def summarized(lines: list[str]) -> Counter[str]:
    """What the periodic summary lines add up to: {"traces in": n, "rejected": n, ...}."""
    found: Counter[str] = Counter()
    for line in lines:
        if " INFO atropos.summary: in the last " in line:
            for part in line.split(" s: ", 1)[1].strip().split(", "):
                n, what = part.split(" ", 1)
                found[what] += int(n)
    return found


@pytest.mark.process
def test_info_gets_a_periodic_summary_not_a_line_per_trace(
    start_hub_process: Any, tmp_path: Path
) -> None:
    hub = start_hub_process({"db_path": str(tmp_path / "t.db"), "log_summary_seconds": 0.5,
                             "flush_interval_seconds": 0.2},
                            distributor={"batch_size": 10, "min_reward_threshold": -1e9})
    streak = [{"type": "action", "tool": "t", "arguments": {}},
              {"type": "observation", "content": "x", "error": "boom"}] * 3
    with hub.client() as client:
        for n in range(20):
            assert client.post("/v1/traces", json=native_trace(trace_id=f"t-{n}")).status_code == 202
        assert client.post("/v1/traces", json=native_trace(trace_id="streak", steps=streak)
                           ).json()["stage"] == "rejected"
    wait_until(lambda: summarized(hub.lines)["batches delivered"] == 2, timeout=60,
               what="both batches in the summary lines")
    said = summarized(hub.lines)
    assert (said["traces in"], said["rejected"], said["batches delivered"]) == (21, 1, 2), hub.log
    # No line names a trace that is not the first or last of a batch (as a word: the
    # database's path holds pytest's run number, "pytest-502").
    assert not [line for line in hub.lines if re.search(r"\bt-5\b", line)], hub.log


@pytest.mark.process
def test_the_import_clients_requests_are_debug_lines(
    start_hub_process: Any, tmp_path: Path
) -> None:
    hub = start_hub_process({"db_path": str(tmp_path / "t.db")})
    config = str(write_config(tmp_path, {"db_path": str(tmp_path / "t.db")}))
    traces = tmp_path / "traces.jsonl"
    traces.write_text(json.dumps(native_trace(trace_id="one")) + "\n")
    quiet = run_cli("import", "--config", config, "--url", hub.url, str(traces))
    assert quiet.returncode == 0 and "HTTP Request" not in quiet.stderr, quiet.stderr
    told = run_cli("import", "--config", config, "--url", hub.url, str(traces),
                   "--log-level", "debug")
    assert told.returncode == 0, told.stderr
    assert f"HTTP Request: POST {hub.url}/v1/traces" in told.stderr, told.stderr
    # Not the HTTP driver's every step: DEBUG is the hub's detail, not its libraries'.
    assert " httpcore." not in told.stderr, told.stderr
