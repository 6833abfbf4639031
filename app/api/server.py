"""The HTTP server: uvicorn, with the guard against slow clients it lacks.

uvicorn times out only idle keep-alive connections: a request whose headers or body
stop arriving holds its connection, and a file descriptor, for ever (20,000 of them
left /healthz unreachable). Its protocol is extended here with:

- `trace_server.header_timeout_seconds`: a request's headers must be in this long
  after its first byte (or after the connection opened);
- `trace_server.body_timeout_seconds`: the longest its body may stall while the hub
  is reading it (nginx's client_body_timeout);
- a bound on the size of the headers (httptools sets none);

each answered 408 (431 for the size) with `Connection: close`; a connection that never
sent a byte is just closed. And uvicorn writes a response's status line and headers,
then its body, as two writes: two send() calls, each of which runs the client's side
of loopback TCP and wakes it. The writes of one turn of the event loop go out as one
(`_OneWritePerTurn`). `trace_server.max_connections` caps connections: requests
past it get 503 (uvicorn's limit_concurrency), and the process may open that many
files (its soft limit is raised, within the hard one).
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import resource
import socket
from collections.abc import Iterable
from typing import Any, cast

import orjson
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from app.config import HubConfig, TraceServerConfig
from app.errors import ConfigError

log = logging.getLogger("atropos.api")

# Request line and headers; Node's and Go's servers stop at 16 KB and 1 MB.
MAX_HEADER_BYTES = 64 * 1024
# File descriptors besides connections: database, ingest processes, logs, runs.
_SPARE_FILES = 256


def listening_socket(ts: TraceServerConfig) -> socket.socket:
    """The API's socket, bound before anything else is done: a port in use stops
    start-up in one line, before a database is created or a process started."""
    family = socket.AF_INET6 if ":" in ts.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((ts.host, ts.port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"port {ts.port} on {ts.host} is in use (another hub?): stop what listens "
                "there, or choose another port with trace_server.port in config.json or "
                "ATROPOS_TRACE_SERVER__PORT"
            ) from None
        raise ConfigError(
            f"cannot listen on {ts.host}:{ts.port} ({exc.strerror}): set trace_server.host "
            "and .port in config.json"
        ) from None
    return sock


def exposure(config: HubConfig) -> str | None:
    """What to warn of when the API listens beyond this machine with auth off."""
    host = config.trace_server.host
    if config.auth.enabled or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass  # a host name: it may resolve to any interface
    return (
        f"listening on {host} with auth off: anyone who can reach this machine reads "
        "every trace, posts reviews and can empty the Atropos queue (GET /reset_data). "
        'Set trace_server.host to "127.0.0.1", or turn on auth.enabled (docs/access.md)'
    )


def server_config(app: Any, ts: TraceServerConfig, **options: Any) -> uvicorn.Config:
    """uvicorn's config for the API, with the guarded protocol and the connection cap."""
    _allow_files(ts.max_connections + _SPARE_FILES)
    return uvicorn.Config(
        app,
        host=ts.host,
        port=ts.port,
        http=guarded_protocol(ts.header_timeout_seconds, ts.body_timeout_seconds),
        limit_concurrency=ts.max_connections,
        # uvicorn believes X-Forwarded-For from 127.0.0.1 by default: any local
        # client could pick its address (and its rate-limit bucket). Only listed
        # proxies are believed.
        proxy_headers=bool(ts.forwarded_allow_ips),
        forwarded_allow_ips=ts.forwarded_allow_ips or None,
        **options,
    )


def guarded_protocol(header_timeout: float, body_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol (httptools where installed, as uvicorn's "auto"
    picks) with the timeouts."""
    base: type[asyncio.Protocol]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = HttpToolsProtocol
    except ImportError:
        base = H11Protocol
    attributes = {"header_timeout": header_timeout, "body_timeout": body_timeout}
    return type(f"Guarded{base.__name__}", (_Guard, base), attributes)


class _Guard(asyncio.Protocol):
    """Mixed in before a uvicorn protocol class. One timer per connection, for what
    the connection is waiting on: a request's headers, or more of its body."""

    header_timeout: float
    body_timeout: float
    # uvicorn's protocol attributes.
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any  # the request in progress, or the last one; None before the first
    flow: Any

    _waiting: str | None = None  # "headers", "body" or None (nothing from the client)
    _deadline = 0.0
    _timer: asyncio.TimerHandle | None = None
    _header_bytes = 0  # received while waiting for headers; 0: the connection is idle
    _known_cycle: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike; and so is
        # the wrapper.
        joined = _OneWritePerTurn(cast(asyncio.Transport, transport), self.loop)
        super().connection_made(cast(asyncio.Transport, joined))
        self._wait("headers", self.header_timeout)

    def data_received(self, data: bytes) -> None:
        if self._waiting == "headers":
            self._header_bytes += len(data)
        super().data_received(data)
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not self._known_cycle:  # a request's headers are in
            self._known_cycle = cycle
            self._waiting = None
        if cycle is None or cycle.response_complete:
            # Bytes of the next request (or of a body the hub did not read).
            if self._waiting != "headers":
                self._header_bytes = len(data)
                self._wait("headers", self.header_timeout)
            if self._header_bytes > MAX_HEADER_BYTES:
                self._refuse(431, "Request Header Fields Too Large",
                             f"the request line and headers pass {MAX_HEADER_BYTES} bytes")
        elif cycle.more_body:
            self._wait("body", self.body_timeout)
        else:
            self._waiting = None  # the whole request is in; the hub is answering

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def _wait(self, what: str, seconds: float) -> None:
        self._waiting = what
        self._deadline = self.loop.time() + seconds
        if self._timer is not None and self._timer.when() > self._deadline:
            self._timer.cancel()
            self._timer = None
        if self._timer is None:
            self._timer = self.loop.call_at(self._deadline, self._expired)

    def _expired(self) -> None:
        self._timer = None
        if self._waiting is None or self.transport.is_closing():
            return
        cycle = self.cycle
        # Not the client's delay: the hub stopped reading (a pipelined request waits)
        # or has not asked for the body yet (Expect: 100-continue).
        held = self.flow.read_paused or (
            self._waiting == "body" and getattr(cycle, "waiting_for_100_continue", False)
        )
        if held:
            self._deadline = self.loop.time() + (
                self.header_timeout if self._waiting == "headers" else self.body_timeout
            )
        if self.loop.time() < self._deadline:
            self._timer = self.loop.call_at(self._deadline, self._expired)
            return
        if self._waiting == "headers":
            if self._header_bytes == 0:
                self.transport.close()  # idle: nothing to answer
                return
            key, seconds, what = "header_timeout_seconds", self.header_timeout, "headers"
        else:
            key, seconds, what = "body_timeout_seconds", self.body_timeout, "body"
        self._refuse(
            408, "Request Timeout",
            f"the request {what} did not arrive in time (trace_server.{key} is {seconds:g} s)",
            field=f"trace_server.{key}",
        )

    def _refuse(self, status: int, reason: str, message: str, field: str | None = None) -> None:
        """Answer, unless the app has begun to, and close. The request being read (if
        any) sees a disconnect, and whatever its handler answers goes nowhere."""
        self._waiting = None
        cycle = self.cycle
        answered = cycle is not None and cycle.response_started and not cycle.response_complete
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        if not answered:
            error: dict[str, Any] = {"code": "request_timeout" if status == 408 else
                                     "headers_too_large", "message": message}
            if field is not None:
                error["field"] = field
            body = orjson.dumps({"error": error})
            self.transport.write(
                f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
                f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body
            )
        self.transport.close()


# Writes are joined up to this many bytes; past it they go to the transport at once,
# whose buffer limits then pause a large streamed response as they did before.
_JOINED_BYTES = 16 * 1024


class _OneWritePerTurn:
    """A connection's transport whose writes are joined until the end of the turn of
    the event loop they were made in: a response's head and body (written one after
    the other, with nothing awaited between) leave in one send(). Everything else is
    the transport's own; closing sends what is held first."""

    __slots__ = ("_transport", "_loop", "_held", "_size")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []
        self._size = 0

    def write(self, data: bytes) -> None:
        if not self._held:
            self._loop.call_soon(self._send)
        self._held.append(data)
        self._size += len(data)
        if self._size >= _JOINED_BYTES:
            self._send()

    def writelines(self, chunks: Iterable[bytes]) -> None:
        for data in chunks:
            self.write(data)

    def close(self) -> None:
        self._send()
        self._transport.close()

    def _send(self) -> None:
        if not self._held:
            return
        data = b"".join(self._held)
        self._held.clear()
        self._size = 0
        if not self._transport.is_closing():
            self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _allow_files(needed: int) -> None:
    """Raise this process's soft limit on open files to `needed`, within the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    new = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    if new < needed:
        log.warning(
            "this process may open %d files (hard limit), fewer than "
            "trace_server.max_connections needs (%d): raise the limit (ulimit -Hn, "
            "LimitNOFILE=) or lower max_connections",
            new,
            needed,
        )
