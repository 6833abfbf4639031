"""The gateway's connections to its upstreams.

aiohttp rather than the hub's httpx client: every agent step passes through here, and
httpx's per-request work (its connection pool's scan of every idle connection, anyio's
stream wrappers) cost the serving process more than the rest of a call put together
(bench/gateway.py, docs/decisions.md). aiohttp's errors are translated here, at the
boundary, into the hub's: an upstream that cannot be reached is a `BadGateway`, one
that does not answer in time a `GatewayTimeout`; a stream that breaks once its answer
has begun is an `UpstreamBroken`, which the caller records in the capture.
"""

from __future__ import annotations

import functools
import urllib.request
from collections.abc import AsyncIterator, Mapping
from contextlib import contextmanager
from typing import Any

import aiohttp
from multidict import CIMultiDictProxy
from yarl import URL

from app.errors import BadGateway, GatewayTimeout
from app.llm import shown


class UpstreamBroken(Exception):
    """The upstream's answer broke off after it had begun."""


class Answer:
    """An upstream's answer, its body still to be read (whole or as it arrives)."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status_code = response.status
        self.headers: CIMultiDictProxy[str] = response.headers

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    async def read(self) -> bytes:
        """The whole body; the connection goes back to the pool."""
        with _broken():
            try:
                return await self._response.read()
            finally:
                self._response.release()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives."""
        with _broken():
            async for data in self._response.content.iter_any():
                yield data

    def close(self) -> None:
        """Done with the answer, read whole or not (the connection of one not read to
        its end is dropped, not reused)."""
        self._response.release()


class Upstreams:
    """One connection pool to every upstream; `start` and `close` belong to the hub's
    lifespan (a session is bound to the event loop it is made on)."""

    def __init__(self, max_connections: int, timeout_seconds: float) -> None:
        self._max_connections = max_connections
        self._timeout_seconds = timeout_seconds
        # Connecting, and each wait for bytes: the tinker section's timeout_seconds, as
        # the hub's other calls to a model use it.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_seconds,
                                              sock_read=timeout_seconds)
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0,
                                           keepalive_timeout=_IDLE_SECONDS),
            timeout=self._timeout,
            auto_decompress=True,
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(self, method: str, url: str, headers: Mapping[str, str],
                   body: bytes | None = None) -> Answer:
        """The upstream's answer, once its status and headers came; BadGateway or
        GatewayTimeout when none comes."""
        assert self._session is not None, "Upstreams.start() was not called"
        try:
            response = await self._session.request(method, url, data=body,
                                                   headers=dict(headers),
                                                   allow_redirects=False,
                                                   proxy=_proxy(URL(url).origin()))
        except TimeoutError as exc:
            raise GatewayTimeout(
                f"the upstream ({shown(url)}) did not answer within "
                f"{self._timeout_seconds:g} s (tinker.timeout_seconds): "
                f"{type(exc).__name__}", field="tinker.timeout_seconds") from None
        except aiohttp.ClientError as exc:
            raise BadGateway(
                f"the upstream ({shown(url)}) could not be reached: "
                f"{type(exc).__name__}: {exc}", field="gateway.upstream.base_url") from None
        return Answer(response)


# How long an idle connection to an upstream is kept: under the 5 s after which uvicorn
# (vLLM's and SGLang's server) closes one, so that the hub closes it first. A call sent
# on a connection as the upstream closes it is reset, and cannot be sent again (the
# upstream may have taken it): the agent, back from a tool after a few seconds, would
# get a 502.
_IDLE_SECONDS = 4.0


@functools.lru_cache(maxsize=256)
def _proxy(origin: URL) -> str | None:
    """The proxy HTTP(S)_PROXY and NO_PROXY name for an upstream, as httpx honours them;
    read once per upstream (aiohttp's trust_env would read them, and ~/.netrc, in a
    thread for every call)."""
    if origin.host is None or urllib.request.proxy_bypass(origin.host):
        return None
    return urllib.request.getproxies_environment().get(origin.scheme)


@contextmanager
def _broken() -> Any:
    try:
        yield
    except TimeoutError:
        raise UpstreamBroken("ReadTimeout") from None
    except aiohttp.ClientError as exc:
        raise UpstreamBroken(type(exc).__name__) from None
