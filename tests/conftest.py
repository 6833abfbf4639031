"""The fixtures. Hubs run in this process (tests/support/hubs.py) unless a test needs a
process of its own (start_hub_process); databases are a SQLite file, and PostgreSQL
when the ATROPOS_TEST_DATABASE_URL cluster is there (CI always provides it). The
helpers behind them live in tests/support/."""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.databases import PG_ADMIN_URL, PgDatabases, SqliteTemplate
from tests.support.fakes.model_server import FakeModel, serve
from tests.support.fakes.vllm_server import FakeVllm
from tests.support.fakes.vllm_server import serve as serve_vllm
from tests.support.hubs import InProcessHub, write_config
from tests.support.processes import HubProcess
from tests.support.runs import RunsEnv


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if PG_ADMIN_URL or not os.environ.get("CI"):
        return
    raise pytest.UsageError("CI must provide ATROPOS_TEST_DATABASE_URL (see .ci/run)")


def pytest_sessionfinish(session: pytest.Session) -> None:
    _pg_databases.drop_all()
    _sqlite_template.remove()


# --- databases -------------------------------------------------------------------

# Of this process (an xdist worker).
_pg_databases = PgDatabases()
_sqlite_template = SqliteTemplate()


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
    """The `trace_server` section of a config.json for a fresh database at the current
    schema, its tables empty: what a hub finds after its first start."""
    yield from _trace_server(dialect, tmp_path, migrated=True)


@pytest.fixture
def empty_trace_server(dialect: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The same for an empty database, no schema at all: what a hub's first start
    finds."""
    yield from _trace_server(dialect, tmp_path, migrated=False)


def _trace_server(dialect: str, tmp_path: Path, *, migrated: bool) -> Iterator[dict[str, Any]]:
    if dialect == "sqlite":
        path = tmp_path / "traces.db"
        if migrated:
            _sqlite_template.copy_to(path)
        yield {"storage_backend": "sqlite", "db_path": str(path)}
        return
    url = _pg_databases.take(migrated=migrated)
    yield {"storage_backend": "postgresql", "database_url": url}
    _pg_databases.give_back(url)


# --- hubs ------------------------------------------------------------------------

StartHub = Callable[..., InProcessHub]
StartHubProcess = Callable[..., HubProcess]


@pytest.fixture
def start_hub(tmp_path: Path) -> Iterator[StartHub]:
    """start_hub(trace_server, *serve_args, listen=False, clock=None, **sections) -> a
    running in-process hub (tests/support/hubs.py), stopped afterwards."""
    hubs: list[InProcessHub] = []

    def start(trace_server: dict[str, Any], *args: str, listen: bool = False,
              clock: Callable[[], float] = time.monotonic, **sections: Any) -> InProcessHub:
        hub = InProcessHub(write_config(tmp_path, trace_server, **sections), *args,
                           listen=listen, clock=clock)
        hubs.append(hub)
        return hub.start()

    yield start
    for hub in reversed(hubs):
        hub.stop()


@pytest.fixture
def start_hub_process(tmp_path: Path) -> Iterator[StartHubProcess]:
    """start_hub_process(trace_server, *serve_args, **sections) -> a running
    `atropos serve` process, killed afterwards: for signals, kill -9, the log it prints."""
    hubs: list[HubProcess] = []

    def start(trace_server: dict[str, Any], *args: str, **sections: Any) -> HubProcess:
        hub = HubProcess(write_config(tmp_path, trace_server, **sections), *args)
        hubs.append(hub)
        return hub.start()

    yield start
    for hub in hubs:
        hub.kill()


@pytest.fixture
def hub(start_hub: StartHub, trace_server: dict[str, Any]) -> InProcessHub:
    return start_hub(trace_server)


@pytest.fixture
def client(hub: InProcessHub) -> Iterator[httpx.Client]:
    with hub.client() as c:
        yield c


@pytest.fixture
async def aclient(hub: InProcessHub) -> AsyncIterator[httpx.AsyncClient]:
    async with hub.async_client() as c:
        yield c


@pytest.fixture
def runs_env(tmp_path: Path, trace_server: dict[str, Any],
             monkeypatch: pytest.MonkeyPatch) -> Iterator[RunsEnv]:
    env = RunsEnv(tmp_path, trace_server, monkeypatch)
    yield env
    env.kill_everything()


# --- a chat tokenizer ---------------------------------------------------------------


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    """A Hugging Face tokenizer directory with a chat template, built offline."""
    from tests.support.chat_tokenizer import chat_tokenizer  # transformers: only if used

    return chat_tokenizer(tmp_path / "tokenizer")


@pytest.fixture
def tinker_args(tmp_path: Path, tokenizer_dir: Path) -> list[str]:
    """`serve` arguments for a tinker.json whose tinker.tokenizer is the test's."""
    tinker = tmp_path / "tinker.json"
    tinker.write_text(json.dumps({"tinker": {"tokenizer": str(tokenizer_dir)}}))
    return ["--tinker", str(tinker)]


# --- fake servers ----------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[FakeVllm, str]]:
    """A vLLM-like model server (tests/support/fakes/vllm_server.py) and its base URL."""
    fake = FakeVllm()
    with serve_vllm(fake) as url:
        yield fake, url


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
