"""What the training-run tests share: a hub with runs enabled and model keys in its
environment, the stand-in process (runs_child.py) and its event log, waiting for a
status, and a dump of the run tables to search for secrets."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.support.hubs import InProcessHub, write_config
from tests.support.processes import HubProcess
from tests.support.waiting import wait_until

CHILD = Path(__file__).with_name("runs_child.py")
KEY_ENV = "RUNS_TEST_MODEL_KEY"
FINISHED = {"completed", "failed", "stopped"}


@dataclass
class RunsEnv:
    """The files and secrets of one test: its hubs share them."""

    tmp: Path
    trace_server: dict[str, Any]
    monkeypatch: pytest.MonkeyPatch
    model_key: str = field(default_factory=lambda: f"sk-model-{uuid.uuid4().hex}")
    tinker_key: str = field(default_factory=lambda: f"tk-tinker-{uuid.uuid4().hex}")
    hubs: list[InProcessHub | HubProcess] = field(default_factory=list)

    @property
    def logs_dir(self) -> Path:
        return self.tmp / "logs"

    @property
    def events_path(self) -> Path:
        return self.tmp / "events.jsonl"

    def hub(self, *, enabled: bool = True, listen: bool = False, **runs: Any) -> InProcessHub:
        """A started in-process hub with runs enabled and the model keys set."""
        for name, value in self._env().items():
            self.monkeypatch.setenv(name, value)
        hub = InProcessHub(*self._serve_args(enabled, runs), listen=listen).start()
        self.hubs.append(hub)
        return hub

    def hub_process(self, **runs: Any) -> HubProcess:
        """A started `atropos serve` process with runs enabled and the model keys set."""
        hub = HubProcess(*self._serve_args(True, runs), env=self._env()).start()
        self.hubs.append(hub)
        return hub

    def _env(self) -> dict[str, str]:
        return {KEY_ENV: self.model_key, "TINKER_API_KEY": self.tinker_key}

    def _serve_args(self, enabled: bool, runs: dict[str, Any]) -> tuple[Path, str, str]:
        tinker = self.tmp / "tinker.json"
        tinker.write_text(
            json.dumps({"tinker": {"base_url": "http://127.0.0.1:9/api", "api_key_env": KEY_ENV}})
        )
        config = write_config(
            self.tmp,
            self.trace_server,
            runs={"enabled": enabled, "logs_dir": str(self.logs_dir),
                  "allow_without_auth": True, **runs},
        )
        return config, "--tinker", str(tinker)

    def child(self, name: str, *args: Any) -> list[str]:
        """The command of a stand-in process that records its events."""
        return [sys.executable, str(CHILD), "--name", name, "--events", str(self.events_path),
                *map(str, args)]

    def events(self) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        return [json.loads(line) for line in self.events_path.read_text().splitlines()]

    def event_time(self, name: str, event: str) -> float:
        times = [e["t"] for e in self.events() if e["name"] == name and e["event"] == event]
        assert times, f"{name} never recorded {event!r}: {self.events()}"
        return float(times[0])

    def kill_everything(self) -> None:
        """Whatever a failing test left running: every group a stand-in ran in."""
        for hub in self.hubs:
            if isinstance(hub, HubProcess):
                hub.kill()
            else:
                hub.stop()
        for pgid in {e["pgid"] for e in self.events()}:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def spec(trainer: list[str], *environments: list[str], **options: Any) -> dict[str, Any]:
    """A run spec with short intervals, so that tests take seconds.

    Health checks go in `trainer_health` / `env_health` (a list, one per environment)."""
    env_health = options.pop("env_health", [None] * len(environments))
    trainer_health = options.pop("trainer_health", None)
    start_timeout = options.pop("start_timeout", 20)
    body: dict[str, Any] = {
        "trainer": {"command": trainer, "start_timeout": start_timeout},
        "environments": [
            {"command": command, "start_timeout": start_timeout}
            for command in environments
        ],
        "poll_interval": 0.2,
        "stop_timeout": 5,
        **options,
    }
    if trainer_health:
        body["trainer"]["health"] = trainer_health
    for env, health in zip(body["environments"], env_health):
        if health:
            env["health"] = health
    return body


def start(client: httpx.Client, body: dict[str, Any]) -> str:
    response = client.post("/v1/runs", json=body)
    assert response.status_code == 201, response.text
    run_id: str = response.json()["run_id"]
    return run_id


def wait_status(
    client: httpx.Client, run_id: str, statuses: set[str] | str, timeout: float = 20
) -> dict[str, Any]:
    wanted = {statuses} if isinstance(statuses, str) else statuses
    run: dict[str, Any] = {}

    def reached() -> bool:
        nonlocal run
        run = client.get(f"/v1/runs/{run_id}").json()
        return run["status"] in wanted

    wait_until(reached, timeout, what=f"run {run_id} {wanted}")
    return run


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def run_tables(trace_server: dict[str, Any]) -> str:
    """Every row of the run tables, as text, to search for what must not be there."""
    tables = ("runs", "run_processes")
    if trace_server["storage_backend"] == "sqlite":
        with sqlite3.connect(trace_server["db_path"]) as conn:
            rows = [conn.execute(f"SELECT * FROM {t}").fetchall() for t in tables]
        return repr(rows)

    import asyncio

    async def dump() -> str:
        conn = await asyncpg.connect(trace_server["database_url"])
        try:
            return repr([await conn.fetch(f"SELECT * FROM {t}") for t in tables])
        finally:
            await conn.close()

    return asyncio.run(dump())
