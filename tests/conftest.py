"""Shared test harness: real databases (a SQLite file, and PostgreSQL when the
ATROPOS_TEST_DATABASE_URL cluster is there; CI always provides it) and real hub
processes (`python -m app.cli serve` on 127.0.0.1, driven over HTTP)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from tests.fakes.model_server import FakeModel, serve

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT.parent / "shared" / "fixtures" / "real"
PG_ADMIN_URL = os.environ.get("ATROPOS_TEST_DATABASE_URL")
LISTENING = re.compile(r"Trace server listening on ([\d.]+):(\d+)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if PG_ADMIN_URL or not os.environ.get("CI"):
        return
    raise pytest.UsageError("CI must provide ATROPOS_TEST_DATABASE_URL (see .ci/run)")


# --- databases -------------------------------------------------------------------


def _pg_param() -> Any:
    return pytest.param(
        "postgresql",
        marks=pytest.mark.skipif(
            not PG_ADMIN_URL, reason="no PostgreSQL: set ATROPOS_TEST_DATABASE_URL"
        ),
    )


@pytest.fixture(params=["sqlite", _pg_param()])
def dialect(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def trace_server(dialect: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The `trace_server` section of a config.json for a fresh, empty database."""
    if dialect == "sqlite":
        yield {"storage_backend": "sqlite", "db_path": str(tmp_path / "traces.db")}
        return
    url = create_pg_database()
    yield {"storage_backend": "postgresql", "database_url": url}
    drop_pg_database(url)


def create_pg_database() -> str:
    assert PG_ADMIN_URL
    name = f"t_{uuid.uuid4().hex[:12]}"
    _pg_admin(f'CREATE DATABASE "{name}"')
    return make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)


def drop_pg_database(url: str) -> None:
    name = make_url(url).database
    _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _pg_admin(sql: str) -> None:
    import asyncio

    async def run() -> None:
        conn = await asyncpg.connect(PG_ADMIN_URL)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run())


def db_execute(trace_server: dict[str, Any], statement: str | sa.Executable,
               **params: Any) -> list[dict[str, Any]]:
    """Run one statement on the test database (either dialect) from a sync test, as a
    user with sqlite3/psql would; returns the rows, if any."""
    import asyncio

    from app.config import TraceServerConfig
    from app.db.engine import create_engine

    if isinstance(statement, str):
        statement = sa.text(statement)

    async def run() -> list[dict[str, Any]]:
        engine = create_engine(TraceServerConfig(**trace_server))
        try:
            async with engine.begin() as conn:
                result = await conn.execute(statement, params)
                return [dict(row._mapping) for row in result] if result.returns_rows else []
        finally:
            await engine.dispose()

    return asyncio.run(run())


def make_api_key(trace_server: dict[str, Any], *scopes: str, name: str = "test") -> str:
    """An API key made directly in the database a hub uses (`atropos keys create` has
    its own test); returns the key to send as `Authorization: Bearer <key>`."""
    import asyncio

    from app.access.keys import Scope, create_key
    from app.config import TraceServerConfig
    from app.db.engine import create_engine

    async def make() -> str:
        engine = create_engine(TraceServerConfig(**trace_server))
        try:
            return (await create_key(engine, name, {Scope(s) for s in scopes}))[1]
        finally:
            await engine.dispose()

    return asyncio.run(make())


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`atropos ARGS` in its own process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


# --- hub processes ---------------------------------------------------------------


def write_config(directory: Path, trace_server: dict[str, Any], **sections: Any) -> Path:
    # The default target is jsonl: its files go to the test's directory, not ~/.atropos.
    distributor = sections.pop("distributor", {})
    if distributor.get("target", "jsonl") == "jsonl":
        distributor = {"output_dir": str(directory / "batches"), **distributor}
    config = {
        "trace_server": {"host": "127.0.0.1", "port": 0, **trace_server},
        "distributor": distributor,
        **sections,
    }
    path = directory / f"config-{uuid.uuid4().hex[:6]}.json"
    path.write_text(json.dumps(config))
    return path


class HubProcess:
    """`atropos serve` as a user runs it, in its own process."""

    command = "serve"

    def __init__(self, config: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.config = config
        self.args = args
        self.env = env or {}
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.lines: list[str] = []

    def start(self, timeout: float = 30) -> HubProcess:
        self.lines = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", self.command, "--config", str(self.config),
             *self.args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **self.env},
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # its own process group, as a job in a terminal is
        )
        ready = threading.Event()
        self._reader = threading.Thread(target=self._read, args=(self.proc, ready), daemon=True)
        self._reader.start()
        if not ready.wait(timeout):
            self.kill()
            raise AssertionError("hub did not start:\n" + self.log)
        return self

    def _read(self, proc: subprocess.Popen[str], ready: threading.Event) -> None:
        assert proc.stderr is not None
        with proc.stderr:
            for line in proc.stderr:
                self.lines.append(line)
                if self._ready(line):
                    ready.set()
        ready.set()

    def _ready(self, line: str) -> bool:
        if match := LISTENING.search(line):
            self.url = f"http://{match[1]}:{match[2]}"
            return True
        return False

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kwargs)

    def kill(self) -> None:
        """kill -9: no shutdown code runs."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._reader.join(10)

    def group(self) -> list[int]:
        """The pids in the hub's process group: itself and what it started."""
        assert self.proc is not None
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # exited meanwhile
            if int(fields[2]) == self.proc.pid and fields[0] != "Z":
                pids.append(int(stat.parent.name))
        return pids

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait(timeout)

    def wait(self, timeout: float = 30) -> int:
        """The exit code, once the process has ended and its log is read."""
        assert self.proc is not None
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    def wait_for_log(self, text: str, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log:
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not in the log:\n{self.log}")
            time.sleep(0.05)


class WorkerProcess(HubProcess):
    """`atropos worker`: the background stages alone, ready once they say so."""

    command = "worker"

    def _ready(self, line: str) -> bool:
        return "pipeline ready" in line


@pytest.fixture(scope="module")
def model_server() -> Iterator[tuple[FakeModel, str]]:
    """A fake OpenAI-compatible endpoint (key `FakeModel.key`) for a test module, and its
    root URL; `fake_model` resets it for each test."""
    fake = FakeModel()
    with serve(fake) as root:
        yield fake, root


@pytest.fixture
def fake_model(model_server: tuple[FakeModel, str]) -> FakeModel:
    model_server[0].reset()
    return model_server[0]


@pytest.fixture
def model_root(model_server: tuple[FakeModel, str]) -> str:
    """The fake model server's root URL (no /v1)."""
    return model_server[1]


@pytest.fixture
def start_hub(tmp_path: Path) -> Iterator[Any]:
    """start_hub(trace_server, **sections) -> a running HubProcess, stopped afterwards."""
    hubs: list[HubProcess] = []

    def start(trace_server: dict[str, Any], *args: str, **sections: Any) -> HubProcess:
        hub = HubProcess(write_config(tmp_path, trace_server, **sections), *args).start()
        hubs.append(hub)
        return hub

    yield start
    for hub in hubs:
        hub.kill()


@pytest.fixture
def hub(start_hub: Any, trace_server: dict[str, Any]) -> HubProcess:
    hub: HubProcess = start_hub(trace_server)
    return hub


@pytest.fixture
def client(hub: HubProcess) -> Iterator[httpx.Client]:
    with hub.client() as c:
        yield c


@pytest.fixture
async def aclient(hub: HubProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=hub.url, timeout=30) as c:
        yield c


def native_trace(**overrides: Any) -> dict[str, Any]:
    """A small, valid native trace: a thought, a tool call, its result, a final answer."""
    trace: dict[str, Any] = {
        "task": "How many lines are in notes.txt?",
        "agent": {"name": "hermes", "model": "example/model-8b"},
        "env": "shell",
        "steps": [
            {"type": "thought", "content": "Count them with wc."},
            {"type": "action", "tool": "terminal", "arguments": {"command": "wc -l notes.txt"},
             "call_id": "c1"},
            {"type": "observation", "call_id": "c1", "content": "12 notes.txt", "exit_code": 0},
            {"type": "final", "content": "notes.txt has 12 lines."},
        ],
        "outcome": {"status": "success"},
    }
    trace.update(overrides)
    return trace
