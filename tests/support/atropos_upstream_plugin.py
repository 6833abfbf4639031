"""pytest plugin for running atroposlib's own API tests against the hub.

Those tests start their server with `python -m atroposlib.cli.run_api --host H
--port P` (through subprocess.Popen) and talk HTTP to it. Loaded with
`-p tests.support.atropos_upstream_plugin`, this plugin turns exactly that command into
`python -m app.cli serve` on H:P over a fresh, empty database per launch (a
restarted run-api starts empty too), and leaves every other command alone.

Environment (set by tests/test_atropos_upstream.py):
  ATROPOS_UPSTREAM_DIR      where configs, SQLite files and hub logs go
  ATROPOS_UPSTREAM_BACKEND  sqlite | postgresql (a database per launch, dropped
                            at the end; needs ATROPOS_TEST_DATABASE_URL)
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT
from tests.support.databases import create_pg_database, drop_pg_database
from tests.support.hubs import write_config

RUN_API = "atroposlib.cli.run_api"
_RealPopen = subprocess.Popen
_databases: list[str] = []


class _HubPopen(_RealPopen):  # type: ignore[type-arg]
    def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
        command = list(args) if isinstance(args, (list, tuple)) else None
        if command and _launches_run_api(command):
            args, kwargs = _hub_launch(command, kwargs)
        super().__init__(args, *rest, **kwargs)


def _launches_run_api(command: list[Any]) -> bool:
    return any(command[i] == "-m" and command[i + 1] == RUN_API for i in range(len(command) - 1))


def _hub_launch(command: list[Any], kwargs: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    host = _option(command, "--host", "0.0.0.0")
    port = int(_option(command, "--port", "8000"))
    directory = Path(os.environ["ATROPOS_UPSTREAM_DIR"])
    launch = uuid.uuid4().hex[:8]
    if os.environ.get("ATROPOS_UPSTREAM_BACKEND") == "postgresql":
        url = create_pg_database()
        _databases.append(url)
        backend: dict[str, Any] = {"storage_backend": "postgresql", "database_url": url}
    else:
        backend = {"storage_backend": "sqlite", "db_path": str(directory / f"hub-{launch}.db")}
    config = write_config(directory, {**backend, "host": host, "port": port})
    # Their tests pipe the server's output and never read it; a file cannot fill up.
    log = open(directory / f"hub-{launch}.log", "w")  # noqa: SIM115 (lives with the process)
    kwargs = {
        **kwargs,
        "cwd": ROOT,
        "env": {**os.environ, "PYTHONPATH": str(ROOT)},
        "stdout": log,
        "stderr": subprocess.STDOUT,
    }
    python = str(command[0])
    return [python, "-m", "app.cli", "serve", "--config", str(config), "--no-workers"], kwargs


def _option(command: list[Any], name: str, default: str) -> str:
    for i, part in enumerate(command[:-1]):
        if part == name:
            return str(command[i + 1])
    return default


def pytest_configure(config: pytest.Config) -> None:
    subprocess.Popen = _HubPopen  # type: ignore[misc]


def pytest_unconfigure(config: pytest.Config) -> None:
    subprocess.Popen = _RealPopen  # type: ignore[misc]
    for url in _databases:
        drop_pg_database(url)
