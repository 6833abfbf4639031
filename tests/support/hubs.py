"""Hubs under test. Most tests use InProcessHub: `atropos serve`'s app, built as the
command builds it from the same config files, run in the test's process on an event
loop of its own and driven through httpx.ASGITransport, with no socket and no
interpreter to start. tests/support/processes.py has the hub in its own process, for
what only a process shows: signals, kill -9, several processes, the command's output."""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import json
import logging
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import CancelledError as FutureCancelled
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn
from asgi_lifespan import LifespanManager

from app.api.app import create_app
from app.api.server import server_config
from app.config import Settings, load_compression, load_config, load_tinker
from app.db.migrate import open_database
from app.evaluation.environment import Environment
from app.hub import Hub
from app.tokens import encoding
from tests.support.waiting import wait_until, wait_until_async

T = TypeVar("T")
# As `atropos serve` formats its log lines (app/cli/main.py).
LOG_FORMAT = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
# The address of an in-process hub's clients: no socket listens there. A port, as a
# server's address has one (the runs API hands it to the run's processes).
ASGI_URL = "http://hub.test:8000"


def write_config(directory: Path, trace_server: dict[str, Any], **sections: Any) -> Path:
    """A config.json with these sections; the hub listens on 127.0.0.1, a free port.
    The default target is jsonl: its files go to the test's directory, not ~/.atropos."""
    distributor = sections.pop("distributor", {})
    if distributor.get("target", "jsonl") == "jsonl":
        distributor = {"output_dir": str(directory / "batches"), **distributor}
    config = {
        # hub.test: the name an in-process hub's clients use (ASGI_URL).
        "trace_server": {"host": "127.0.0.1", "port": 0, "allowed_hosts": ["hub.test"],
                         **trace_server},
        "distributor": distributor,
        **sections,
    }
    path = directory / f"config-{uuid.uuid4().hex[:6]}.json"
    path.write_text(json.dumps(config))
    return path


class HubUnderTest:
    """What every hub under test offers: its config file, its address, a client, and the
    lines it logged since it last started."""

    config: Path
    url: str
    lines: list[str]

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_for_log(self, text: str, timeout: float = 10) -> None:
        try:
            wait_until(lambda: text in self.log, timeout, what=f"{text!r} in the log")
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{self.log}") from None

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kwargs)


def serve_options(args: tuple[str, ...]) -> argparse.Namespace:
    """The options of `atropos serve` besides --config."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--compression")
    parser.add_argument("--tinker")
    parser.add_argument("--no-workers", action="store_true")
    return parser.parse_args(args)


class InProcessHub(HubUnderTest):
    """`atropos serve --config CONFIG ARGS` in this process: built as app/cli/main.py's
    `serve` builds it (config files, reward rules and tokenizer, migrated database,
    create_app), its lifespan run by asgi-lifespan's LifespanManager on an event loop in
    a thread of its own. `client()` and `async_client()` hand each request to
    httpx.ASGITransport on that loop, so sync tests, async tests and threads all reach
    the one app. With listen=True, uvicorn serves it on the config's 127.0.0.1 address
    instead, for clients that need a socket (a command in another process, schemathesis).

    The hub sees this process's environment: set its variables with monkeypatch, and
    its rate limits read `clock` (tests/support/clock.py: one the test moves)."""

    def __init__(self, config: Path, *args: str, listen: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.args = args
        self.listen = listen
        self.clock = clock
        self.url = ""
        self.lines = []
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._app: Callable[..., Awaitable[None]] | None = None
        self._state: MutableMapping[str, Any] = {}
        self._error: BaseException | None = None

    def start(self, timeout: float = 60) -> InProcessHub:
        options = serve_options(self.args)
        self.lines = []
        self._state = {}
        self._error = None
        _logs.attach(self.lines)
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(options, ready), name=f"hub {self.config.name}", daemon=True
        )
        self._thread.start()
        if not ready.wait(timeout):
            self.stop()
            raise AssertionError(f"hub did not start in {timeout} s:\n{self.log}")
        if self._error is not None:
            self.stop()
        return self

    def _run(self, options: argparse.Namespace, ready: threading.Event) -> None:
        try:
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                runner.run(self._serve(options, ready))
        except BaseException as exc:  # handed to the test's thread by start() or stop()
            self._error = exc
        finally:
            ready.set()

    async def _serve(self, options: argparse.Namespace, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        settings = Settings(load_config(str(self.config)), load_compression(options.compression),
                            load_tinker(options.tinker))
        environment = Environment.from_config(settings.config.environment)
        encoding()
        engine = await open_database(settings.config)
        app = create_app(settings, environment=environment, engine=engine,
                         workers=not options.no_workers, clock=self.clock)

        async def app_keeping_state(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "lifespan":
                self._state = scope["state"]  # the lifespan puts the Hub there
            await app(scope, receive, send)

        if self.listen:
            ts = settings.config.trace_server
            # uvicorn configured as `atropos serve` configures it (app/api/server.py).
            server = uvicorn.Server(server_config(
                app_keeping_state, ts, log_config=None, access_log=False,
                timeout_graceful_shutdown=30))
            serving = asyncio.create_task(server.serve())
            await wait_until_async(lambda: server.started or serving.done(), 60,
                                   what="uvicorn to start", poll=0.01)
            if not server.started:
                await serving
                raise RuntimeError(f"uvicorn did not start:\n{self.log}")
            host, port = server.servers[0].sockets[0].getsockname()[:2]
            self.url = f"http://{host}:{port}"
            ready.set()
            await self._stopping.wait()
            server.should_exit = True
            await serving
            return
        async def per_request_state(scope: Any, receive: Any, send: Any) -> None:
            # As uvicorn: each request gets a copy of the lifespan's state, so what one
            # request keeps in request.state is not seen by the next (asgi-lifespan's
            # manager.app hands every request the one dict).
            scope["state"] = dict(self._state)
            await app(scope, receive, send)

        async with LifespanManager(app_keeping_state, startup_timeout=60,
                                   shutdown_timeout=60):
            self._app = per_request_state
            self.url = ASGI_URL
            ready.set()
            try:
                await self._stopping.wait()
            finally:
                self._app = None  # requests from now on find the hub stopped

    @property
    def internals(self) -> Hub:
        """The app's own Hub (inserter, ingestor, stages), to wait on a condition that the
        API does not show. Read it, never change it: it lives on the hub's thread."""
        hub: Hub = self._state["hub"]
        return hub

    def run(self, work: Callable[[Hub], Awaitable[T]], timeout: float = 120) -> T:
        """`work(the app's Hub)` run on the hub's own loop, e.g. a stage's method."""
        if self._loop is None or "hub" not in self._state:
            raise AssertionError("the hub is not running")
        done = asyncio.run_coroutine_threadsafe(_awaited(work(self.internals)), self._loop)
        return done.result(timeout)

    def drain(self) -> int:
        """What `atropos worker --burst` does, with this hub's own stages (a hub started
        with --no-workers leaves them to this): run every stage until none has work
        left; returns the items moved on."""
        return self.run(lambda hub: hub.stages.drain())

    def start_stages(self) -> None:
        """What starting `atropos worker` beside a --no-workers hub does, with this hub's
        own stages: they run on until the hub stops."""

        async def start(hub: Hub) -> None:
            hub.stages.start()

        self.run(start)

    def stop(self, timeout: float = 60) -> None:
        """Graceful, as SIGTERM is to `atropos serve`: the lifespan's shutdown runs."""
        thread = self._thread
        if thread is not None:
            if thread.is_alive() and self._loop is not None and self._stopping is not None:
                self._loop.call_soon_threadsafe(self._stopping.set)
            thread.join(timeout)
            if thread.is_alive():
                raise AssertionError(
                    f"hub did not stop in {timeout} s:\n{self.log}\n{_where(thread, self._loop)}"
                )
            self._thread = self._loop = self._stopping = None
            _logs.detach(self.lines)
            gc.unfreeze()  # running_hub froze what lived then; let it be collected again
        error, self._error = self._error, None
        if error is not None:
            raise error

    def kill(self) -> None:
        raise TypeError("an in-process hub cannot be killed -9: start a HubProcess "
                        "(the start_hub_process fixture) for that")

    def client(self, **kwargs: Any) -> httpx.Client:
        if self.listen:
            return super().client(**kwargs)
        return httpx.Client(base_url=self.url, timeout=30, transport=_ToHubLoop(self), **kwargs)

    def async_client(self, **kwargs: Any) -> httpx.AsyncClient:
        if self.listen:
            return httpx.AsyncClient(base_url=self.url, timeout=30, **kwargs)
        return httpx.AsyncClient(base_url=self.url, timeout=30, transport=_ToHubLoopAsync(self),
                                 **kwargs)

    def submit(self, request: httpx.Request) -> Future[httpx.Response]:
        """Hand a (read) request to the app on the hub's loop."""
        if self._app is None or self._loop is None:
            raise httpx.ConnectError("the hub is not running", request=request)
        return asyncio.run_coroutine_threadsafe(self._answer(self._app, request), self._loop)

    @staticmethod
    async def _answer(app: Callable[..., Awaitable[None]], request: httpx.Request
                      ) -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 50000))
        response = await transport.handle_async_request(request)
        body = b"".join([part async for part in response.aiter_raw()])  # still encoded
        return httpx.Response(response.status_code, headers=response.headers,
                              stream=httpx.ByteStream(body))


def _where(thread: threading.Thread, loop: asyncio.AbstractEventLoop | None) -> str:
    """Where a hub that did not stop is stuck: its thread's stack and its loop's tasks."""
    frame = sys._current_frames().get(thread.ident or 0)
    lines = ["the hub's thread:\n", *(traceback.format_stack(frame) if frame else [])]
    stacks = io.StringIO()
    for task in asyncio.all_tasks(loop) if loop is not None else ():
        task.print_stack(file=stacks)
    return "".join(lines) + stacks.getvalue()


async def _awaited(work: Awaitable[T]) -> T:
    return await work


def _read_timeout(request: httpx.Request) -> float | None:
    timeout: float | None = request.extensions.get("timeout", {}).get("read")
    return timeout


class _ToHubLoop(httpx.BaseTransport):
    def __init__(self, hub: InProcessHub) -> None:
        self._hub = hub

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        answer = self._hub.submit(request)
        try:
            return answer.result(_read_timeout(request))
        except FutureTimeout:
            answer.cancel()
            raise httpx.ReadTimeout("the hub did not answer in time", request=request) from None
        except FutureCancelled:
            raise httpx.RemoteProtocolError("the hub stopped before answering",
                                            request=request) from None


class _ToHubLoopAsync(httpx.AsyncBaseTransport):
    def __init__(self, hub: InProcessHub) -> None:
        self._hub = hub

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        answer = asyncio.wrap_future(self._hub.submit(request))
        try:
            return await asyncio.wait_for(answer, _read_timeout(request))
        except TimeoutError:
            raise httpx.ReadTimeout("the hub did not answer in time", request=request) from None


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop, as `atropos serve` runs on where it is installed."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class _LogLines(logging.Handler):
    """Log records as `atropos serve` writes them to stderr, into each running in-process
    hub's `lines`; the root logger at INFO while any runs, as the command sets it."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(LOG_FORMAT)
        self._sinks: list[list[str]] = []
        self._saved: dict[str, int] = {}
        self._lock = threading.Lock()

    def attach(self, lines: list[str]) -> None:
        with self._lock:
            if not self._sinks:
                root, alembic = logging.getLogger(), logging.getLogger("alembic")
                self._saved = {"": root.level, "alembic": alembic.level}
                if root.getEffectiveLevel() > logging.INFO:
                    root.setLevel(logging.INFO)
                alembic.setLevel(logging.WARNING)  # as the command quiets it
                root.addHandler(self)
            self._sinks.append(lines)

    def detach(self, lines: list[str]) -> None:
        with self._lock:
            self._sinks = [s for s in self._sinks if s is not lines]
            if not self._sinks:
                logging.getLogger().removeHandler(self)
                for name, level in self._saved.items():
                    logging.getLogger(name).setLevel(level)

    def emit(self, record: logging.LogRecord) -> None:
        line = self.format(record) + "\n"
        for sink in self._sinks:
            sink.append(line)


_logs = _LogLines()
