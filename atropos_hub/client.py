"""`Client` and `AsyncClient`: traces queued by `log`, sent in the background.

What a client guarantees:

- **Idempotent ids.** `log` gives a trace without a `trace_id` one (a UUID) before it
  is queued, so a batch sent again after a lost answer is stored once: the hub
  answers the stored ones as duplicates.
- **Batches, gzipped.** Up to `batch_size` traces a request (`{"traces": [...]}`),
  sent when that many are waiting or `flush_interval` seconds after the first.
- **Retries.** A connection error, a 5xx, a 429 or a 503 is retried: after the
  `Retry-After` the hub sent, else with exponential backoff from `retry_base`
  seconds up to `retry_max`. A trace the hub refuses (a 4xx of its own, in the
  batch's answer) is not retried: it is in `refused` with the hub's error.
- **Flush on exit.** `close()` (the end of a `with` block; for `Client`, also the
  interpreter's exit) sends what is queued, waiting up to `close_timeout` seconds.

`finish(rollout_id, reward=...)` ends a rollout the hub's model gateway recorded
(`POST /v1/rollouts/{rollout_id}/finish`), after the traces logged before it are sent.
"""

from __future__ import annotations

import asyncio
import atexit
import gzip
import logging
import os
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

__all__ = ["AsyncClient", "Client", "HubError"]

log = logging.getLogger("atropos_hub")

DEFAULT_URL = "http://127.0.0.1:8000"
# Statuses that say "not now": the same request later may succeed.
_RETRIED = frozenset({408, 425, 429, 500, 502, 503, 504})


class HubError(Exception):
    """The hub refused a request for good (a 4xx other than 408/425/429): `status` and
    the hub's error body (`{"code", "message", "field"?}`)."""

    def __init__(self, status: int, error: Mapping[str, Any]) -> None:
        super().__init__(f"{status} {error.get('code')}: {error.get('message')}")
        self.status = status
        self.error = dict(error)


@dataclass
class _Settings:
    url: str
    api_key: str | None
    batch_size: int
    flush_interval: float
    max_queued: int
    timeout: float
    close_timeout: float
    retry_base: float
    retry_max: float

    def headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json", "content-encoding": "gzip"}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        return headers

    def delay(self, attempt: int, response: httpx.Response | None) -> float:
        """How long to wait before attempt `attempt + 1`: the hub's Retry-After when it
        sent one, else exponential backoff."""
        if response is not None:
            retry_after = response.headers.get("retry-after")
            try:
                return max(0.0, float(retry_after)) if retry_after is not None else \
                    self._backoff(attempt)
            except ValueError:
                pass
        return self._backoff(attempt)

    def _backoff(self, attempt: int) -> float:
        return float(min(self.retry_base * 2 ** attempt, self.retry_max))


def _settings(url: str | None, api_key: str | None, **options: Any) -> _Settings:
    return _Settings(
        url=(url or os.environ.get("ATROPOS_HUB_URL") or DEFAULT_URL).rstrip("/"),
        api_key=api_key if api_key is not None else os.environ.get("ATROPOS_API_KEY"),
        **options,
    )


@dataclass
class _Stats:
    """What a client has done: traces acknowledged (stored or duplicates), refused by
    the hub (with its error), and requests retried."""

    sent: int = 0
    duplicates: int = 0
    retries: int = 0
    refused: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def count(self, batch: list[dict[str, Any]], answer: dict[str, Any]) -> None:
        for trace, result in zip(batch, answer["results"]):
            if "error" in result:
                self.refused.append((trace["trace_id"], result["error"]))
                log.warning("the hub refused trace %s: %s", trace["trace_id"],
                            result["error"].get("message"))
            else:
                self.sent += 1
                self.duplicates += bool(result.get("duplicate"))


def _identified(trace: Mapping[str, Any]) -> dict[str, Any]:
    """The trace with its id: the one it has (native `trace_id`, ATIF `session_id`)
    or a new UUID, so that sending it again stores it once."""
    item = dict(trace)
    if not item.get("trace_id") and not item.get("session_id"):
        item["trace_id"] = uuid.uuid4().hex
    return item


def _body(batch: list[dict[str, Any]]) -> bytes:
    return gzip.compress(orjson.dumps({"traces": batch}), compresslevel=5)


def _answer(response: httpx.Response) -> dict[str, Any] | None:
    """The batch's answer; None when the request is to be retried; HubError when
    the hub refused the request itself."""
    if response.status_code in _RETRIED:
        return None
    if response.status_code in (200, 202, 207):
        body: dict[str, Any] = response.json()
        return body
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        error = {"code": "http_error", "message": response.text[:300]}
    raise HubError(response.status_code, error)


def _finish_body(reward: float | None, status: str | None, task: str | None,
                 metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    given = {"reward": reward, "status": status, "task": task, "metadata": metadata}
    return {k: v for k, v in given.items() if v is not None}


class Client:
    """Logs traces to a hub from a background thread; see the module's docstring.

    `url` defaults to ATROPOS_HUB_URL, else http://127.0.0.1:8000; `api_key` to
    ATROPOS_API_KEY (none is sent when unset)."""

    def __init__(
        self,
        url: str | None = None,
        *,
        api_key: str | None = None,
        batch_size: int = 64,
        flush_interval: float = 1.0,
        max_queued: int = 10_000,
        timeout: float = 30.0,
        close_timeout: float = 30.0,
        retry_base: float = 0.5,
        retry_max: float = 30.0,
    ) -> None:
        self._settings = _settings(
            url, api_key, batch_size=batch_size, flush_interval=flush_interval,
            max_queued=max_queued, timeout=timeout, close_timeout=close_timeout,
            retry_base=retry_base, retry_max=retry_max,
        )
        self.stats = _Stats()
        self._queue: deque[dict[str, Any]] = deque()
        self._in_flight = 0
        self._closed = False
        self._hurry = False  # flush or close asked: send what waits without waiting more
        self._changed = threading.Condition()
        self._http = httpx.Client(base_url=self._settings.url, timeout=timeout)
        self._thread = threading.Thread(target=self._send_loop, name="atropos-hub-client",
                                        daemon=True)
        self._thread.start()
        # Flush on exit, without keeping the client alive for it.
        atexit.register(_close_at_exit, weakref.ref(self))

    @property
    def refused(self) -> list[tuple[str, dict[str, Any]]]:
        """(trace_id, the hub's error) of each trace the hub refused."""
        return self.stats.refused

    def log(self, trace: Mapping[str, Any]) -> str:
        """Queue one trace (any format the hub accepts); returns its trace_id. Blocks
        while `max_queued` traces wait (the hub is away)."""
        item = _identified(trace)
        with self._changed:
            if self._closed:
                raise RuntimeError("the client is closed")
            while len(self._queue) >= self._settings.max_queued:
                self._changed.wait()
            self._queue.append(item)
            self._changed.notify_all()
        return str(item.get("trace_id") or item.get("session_id"))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every trace logged so far is acknowledged (or refused); False if
        `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            self._hurry = True  # send now, not at the next interval
            self._changed.notify_all()
            while self._queue or self._in_flight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(left)
            self._hurry = False
        return True

    def finish(self, rollout_id: str, *, reward: float | None = None,
               status: str | None = None, task: str | None = None,
               metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """End a gateway rollout with its reward (and status, task, metadata), once the
        traces logged before are sent. Retried as batches are; HubError if refused."""
        self.flush(self._settings.close_timeout)
        payload = orjson.dumps(_finish_body(reward, status, task, metadata))
        headers = {k: v for k, v in self._settings.headers().items() if k != "content-encoding"}
        return self._request(f"/v1/rollouts/{rollout_id}/finish", payload, headers)

    def close(self) -> None:
        """Send what is queued (up to `close_timeout` seconds), then stop."""
        if self._closed:
            return
        sent = self.flush(self._settings.close_timeout)
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        # A sender still retrying (the hub away) is a daemon: it ends with the process.
        self._thread.join(self._settings.close_timeout if sent else 1.0)
        self._http.close()
        if not sent:
            log.error("closing with %d traces not acknowledged by %s", len(self._queue),
                      self._settings.url)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send_loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                answer = self._request("/v1/traces", _body(batch), self._settings.headers())
                self.stats.count(batch, answer)
            except HubError as exc:
                for trace in batch:
                    self.stats.refused.append((trace["trace_id"], exc.error))
                log.warning("the hub refused a batch of %d: %s", len(batch), exc)
            with self._changed:
                self._in_flight = 0
                self._changed.notify_all()

    def _next_batch(self) -> list[dict[str, Any]] | None:
        """The next batch: `batch_size` traces, or what waits once `flush_interval` has
        passed since the first of them (at once on flush or close)."""
        s = self._settings
        with self._changed:
            while not self._queue:
                if self._closed:
                    return None
                self._changed.wait()
            deadline = time.monotonic() + s.flush_interval
            while len(self._queue) < s.batch_size and not (self._closed or self._hurry):
                left = deadline - time.monotonic()
                if left <= 0 or not self._changed.wait(left):
                    break
            count = min(len(self._queue), s.batch_size)
            batch = [self._queue.popleft() for _ in range(count)]
            self._in_flight = count
            self._changed.notify_all()
            return batch

    def _request(self, path: str, payload: bytes, headers: dict[str, str]) -> dict[str, Any]:
        attempt = 0
        while True:
            response = None
            try:
                response = self._http.post(path, content=payload, headers=headers)
                answer = _answer(response)
                if answer is not None:
                    return answer
            except httpx.TransportError as exc:
                log.debug("hub unreachable (%s); retrying", exc)
            delay = self._settings.delay(attempt, response)
            self.stats.retries += 1
            attempt += 1
            time.sleep(delay)


def _close_at_exit(ref: weakref.ref[Client]) -> None:
    client = ref()
    if client is not None:
        client.close()


class AsyncClient:
    """`Client` for asyncio: `await log(trace)`, a background task sends. Close it with
    `await aclose()` or `async with`: an event loop cannot be awaited at exit."""

    def __init__(
        self,
        url: str | None = None,
        *,
        api_key: str | None = None,
        batch_size: int = 64,
        flush_interval: float = 1.0,
        max_queued: int = 10_000,
        timeout: float = 30.0,
        close_timeout: float = 30.0,
        retry_base: float = 0.5,
        retry_max: float = 30.0,
    ) -> None:
        self._settings = _settings(
            url, api_key, batch_size=batch_size, flush_interval=flush_interval,
            max_queued=max_queued, timeout=timeout, close_timeout=close_timeout,
            retry_base=retry_base, retry_max=retry_max,
        )
        self.stats = _Stats()
        self._queue: deque[dict[str, Any]] = deque()
        self._in_flight = 0
        self._closed = False
        self._hurry = False
        self._changed: asyncio.Condition | None = None
        self._http = httpx.AsyncClient(base_url=self._settings.url, timeout=timeout)
        self._task: asyncio.Task[None] | None = None

    @property
    def refused(self) -> list[tuple[str, dict[str, Any]]]:
        return self.stats.refused

    def _started(self) -> asyncio.Condition:
        # Made on first use: the condition and the task belong to the running loop.
        if self._changed is None:
            self._changed = asyncio.Condition()
            self._task = asyncio.create_task(self._send_loop(), name="atropos-hub-client")
        return self._changed

    async def log(self, trace: Mapping[str, Any]) -> str:
        item = _identified(trace)
        changed = self._started()
        async with changed:
            if self._closed:
                raise RuntimeError("the client is closed")
            await changed.wait_for(lambda: len(self._queue) < self._settings.max_queued)
            self._queue.append(item)
            changed.notify_all()
        return str(item.get("trace_id") or item.get("session_id"))

    async def flush(self, timeout: float | None = None) -> bool:
        changed = self._started()
        try:
            async with asyncio.timeout(timeout):
                async with changed:
                    self._hurry = True
                    changed.notify_all()
                    await changed.wait_for(lambda: not self._queue and not self._in_flight)
                    self._hurry = False
        except TimeoutError:
            return False
        return True

    async def finish(self, rollout_id: str, *, reward: float | None = None,
                     status: str | None = None, task: str | None = None,
                     metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
        await self.flush(self._settings.close_timeout)
        payload = orjson.dumps(_finish_body(reward, status, task, metadata))
        headers = {k: v for k, v in self._settings.headers().items() if k != "content-encoding"}
        return await self._request(f"/v1/rollouts/{rollout_id}/finish", payload, headers)

    async def aclose(self) -> None:
        if self._closed:
            return
        sent = await self.flush(self._settings.close_timeout)
        changed = self._started()
        async with changed:
            self._closed = True
            changed.notify_all()
        if self._task is not None:
            if sent:
                await self._task
            else:
                self._task.cancel()  # still retrying: the hub is away
        await self._http.aclose()
        if not sent:
            log.error("closing with %d traces not acknowledged by %s", len(self._queue),
                      self._settings.url)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send_loop(self) -> None:
        while (batch := await self._next_batch()) is not None:
            try:
                answer = await self._request("/v1/traces", _body(batch),
                                             self._settings.headers())
                self.stats.count(batch, answer)
            except HubError as exc:
                for trace in batch:
                    self.stats.refused.append((trace["trace_id"], exc.error))
                log.warning("the hub refused a batch of %d: %s", len(batch), exc)
            changed = self._started()
            async with changed:
                self._in_flight = 0
                changed.notify_all()

    async def _next_batch(self) -> list[dict[str, Any]] | None:
        s = self._settings
        changed = self._started()
        async with changed:
            await changed.wait_for(lambda: bool(self._queue) or self._closed)
            if not self._queue:
                return None
            try:
                async with asyncio.timeout(s.flush_interval):
                    await changed.wait_for(
                        lambda: len(self._queue) >= s.batch_size or self._closed
                        or self._hurry)
            except TimeoutError:
                pass
            count = min(len(self._queue), s.batch_size)
            batch = [self._queue.popleft() for _ in range(count)]
            self._in_flight = count
            changed.notify_all()
            return batch

    async def _request(self, path: str, payload: bytes,
                       headers: dict[str, str]) -> dict[str, Any]:
        attempt = 0
        while True:
            response = None
            try:
                response = await self._http.post(path, content=payload, headers=headers)
                answer = _answer(response)
                if answer is not None:
                    return answer
            except httpx.TransportError as exc:
                log.debug("hub unreachable (%s); retrying", exc)
            delay = self._settings.delay(attempt, response)
            self.stats.retries += 1
            attempt += 1
            await asyncio.sleep(delay)
