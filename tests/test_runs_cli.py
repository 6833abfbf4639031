"""`atropos run` against a live hub: it prints the run's changes, exits with the
run's outcome, and Ctrl-C stops the run."""

from __future__ import annotations

import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from tests.support import ROOT
from tests.support.runs import RunsEnv, alive

pytestmark = pytest.mark.process


@pytest.fixture
def dialect() -> str:
    """A client of the HTTP API: one database is enough (test_runs_api covers both)."""
    return "sqlite"


class _Cli:
    """`atropos run ...` in its own process, its stdout read line by line."""

    def __init__(self, *args: Any) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "run", *map(str, args)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for line in self.proc.stdout:
                self._queue.put(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            try:
                self.lines.append(self._queue.get(timeout=max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"{text!r} not printed: {self.lines}") from None

    def finish(self, timeout: float = 20) -> int:
        assert self.proc.stderr is not None
        with self.proc.stderr:
            self.stderr = self.proc.stderr.read()
        code = self.proc.wait(timeout)
        self._reader.join(timeout)
        while not self._queue.empty():
            self.lines.append(self._queue.get())
        return code


def _command(runs_env: RunsEnv, name: str, *args: Any) -> str:
    return shlex.join(runs_env.child(name, *args))


def test_ctrl_c_stops_the_run(runs_env: RunsEnv) -> None:
    hub = runs_env.hub(listen=True)
    cli = _Cli(
        "--url", hub.url,
        "--trainer", _command(runs_env, "trainer"), "--trainer-health", "log:trainer started",
        "--env", _command(runs_env, "env0"), "--env-health", "alive:0.3",
        "--poll-interval", 0.2, "--stop-timeout", 2, "--watch-interval", 0.1,
    )
    try:
        cli.wait_for(": running")
        run_id = cli.lines[0].split()[1].rstrip(":")
        cli.proc.send_signal(signal.SIGINT)
        assert cli.finish() == 130
    finally:
        if cli.proc.poll() is None:
            cli.proc.kill()
            cli.finish()
    out = "\n".join(cli.lines)
    for text in (f"run {run_id}: pending", "  trainer: pid ", "  env_0: pid ",
                 f"run {run_id}: running", f"run {run_id}: stopping",
                 "  env_0: exited with code -15 (killed by SIGTERM)",
                 f"run {run_id}: stopped"):
        assert text in out, out
    assert out.index("env_0: exited") < out.index("trainer: exited")
    with hub.client() as client:
        run = client.get(f"/v1/runs/{run_id}").json()
    assert run["status"] == "stopped"
    assert not any(alive(p["pid"]) for p in run["processes"])


def test_the_exit_code_is_the_runs_outcome(runs_env: RunsEnv) -> None:
    hub = runs_env.hub(listen=True)
    common = ("--url", hub.url, "--poll-interval", 0.2, "--watch-interval", 0.1)
    done = _Cli(*common, "--trainer", _command(runs_env, "ok", "--exit-after", 0.5))
    failed = _Cli(*common, "--trainer", _command(runs_env, "bad", "--exit-after", 0.5,
                                                 "--code", 4))
    assert done.finish() == 0
    assert done.lines[-1].endswith(": completed")
    assert failed.finish() == 1
    assert failed.lines[-1].endswith(".log") and "Trainer exited with code 4. Check " in (
        failed.lines[-1]
    )
    refused = _Cli("--url", hub.url, "--trainer", "x", "--set", "OPENAI_API_KEY=mine")
    assert refused.finish() == 2
    assert "OPENAI_API_KEY is set by the hub" in refused.stderr
