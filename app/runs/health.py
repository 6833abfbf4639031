"""Waiting for a freshly started process to be up, by its health check.

Hermes slept fixed times (5, 30, 90 s) and hoped; here each process says how to
tell, and the wait ends as soon as it is true, when the process dies, or at its
start_timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import httpx

from app.runs.process import SupervisedProcess
from app.runs.spec import HealthCheck
from app.waits import event_set_within

# How often a check is tried while waiting: often enough that the next process starts
# soon after this one is up, rarely enough to cost nothing.
PROBE_INTERVAL = 0.2
_HTTP_TIMEOUT = 2.0
_MAX_PARTIAL = 64 * 1024


@dataclass(frozen=True)
class Healthy:
    pass


@dataclass(frozen=True)
class Exited:
    code: int | None


@dataclass(frozen=True)
class TimedOut:
    reason: str


@dataclass(frozen=True)
class Interrupted:
    """A stop was requested while waiting."""


HealthResult = Healthy | Exited | TimedOut | Interrupted


async def wait_until_healthy(
    proc: SupervisedProcess,
    check: HealthCheck | None,
    *,
    timeout: float,
    http: httpx.AsyncClient,
    stop: asyncio.Event,
) -> HealthResult:
    started = time.monotonic()
    deadline = started + timeout
    log = _LogScanner(proc.log_path)
    while True:
        if stop.is_set():
            return Interrupted()
        if not proc.running():
            return Exited(proc.exit_code())
        if check is None:
            return Healthy()
        if await _probe(check, started, log, http):
            return Healthy()
        if time.monotonic() >= deadline:
            return TimedOut(f"not healthy after {timeout:g} s: {check.describe()}")
        await event_set_within(stop, PROBE_INTERVAL)


async def _probe(
    check: HealthCheck, started: float, log: _LogScanner, http: httpx.AsyncClient
) -> bool:
    if check.alive_seconds is not None:
        return time.monotonic() - started >= check.alive_seconds
    if check.log is not None:
        return log.contains(check.log)
    assert check.http is not None
    return await _answers_2xx(http, check.http)


async def _answers_2xx(http: httpx.AsyncClient, url: str) -> bool:
    token = _probing.set(True)
    try:
        response = await http.get(url, timeout=_HTTP_TIMEOUT)
    except httpx.HTTPError:
        return False  # not listening yet, or not answering: try again
    finally:
        _probing.reset(token)
    return response.is_success


# httpx logs every response at INFO; a probe five times a second of a server still
# answering 503 would bury the hub's log. Only the probes are kept out of it.
_probing: ContextVar[bool] = ContextVar("probing", default=False)
logging.getLogger("httpx").addFilter(lambda _record: not _probing.get())


class _LogScanner:
    """Reads a log as it grows and says whether a line has contained some text."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._offset = 0
        self._line = b""  # the line being written, not yet ended by a newline
        self._seen = False

    def contains(self, text: str) -> bool:
        if self._seen:
            return True
        needle = text.encode()
        try:
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return False
        self._offset += len(chunk)
        *complete, self._line = (self._line + chunk).split(b"\n")
        # A process that never ends a line must not grow this without bound; the
        # text can only be in the part of it that the next bytes may still complete.
        self._line = self._line[-_MAX_PARTIAL:]
        # The unfinished line counts too: it already holds what it printed so far.
        self._seen = any(needle in line for line in [*complete, self._line])
        return self._seen
