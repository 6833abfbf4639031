"""The HTTP server against slow clients (app/api/server.py), with real sockets against a
real `atropos serve`: half-sent requests are answered 408 and closed once their
timeout passes, and meanwhile the hub still answers; and a response leaves in one
send()."""

from __future__ import annotations

import asyncio
import resource
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.api.server import _JOINED_BYTES, _OneWritePerTurn

HEADERS_HALF_SENT = b"POST /v1/traces HTTP/1.1\r\nHost: localhost\r\nContent-Le"
BODY_HALF_SENT = (b"POST /v1/traces HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"task\": ")


def _read_to_eof(sock: socket.socket, deadline: float) -> bytes:
    data = b""
    while chunk := _recv(sock, deadline):
        data += chunk
    return data


def _recv(sock: socket.socket, deadline: float) -> bytes:
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        return sock.recv(65536)
    except TimeoutError:
        raise AssertionError("the hub did not close a half-sent request in time") from None
    except ConnectionResetError:
        return b""


@pytest.mark.process
def test_half_sent_requests_are_timed_out_and_the_hub_still_answers(
    start_hub_process: Any, tmp_path: Path
) -> None:
    """2,000 requests that stop half-way, on a hub started with the common soft limit
    of 1,024 open files: it raises its limit to fit trace_server.max_connections,
    answers /healthz meanwhile, and answers each 408 once its timeout has passed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard >= 4096 + 2100, "the test needs to open 2,000 sockets beside the hub"
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # what the hub inherits
    try:
        hub = start_hub_process({"storage_backend": "sqlite", "db_path": str(tmp_path / "t.db"),
                         "header_timeout_seconds": 3, "body_timeout_seconds": 4})
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    host, port = hub.url.removeprefix("http://").split(":")
    held: list[tuple[socket.socket, bytes]] = []
    try:
        for n in range(2000):
            sock = socket.create_connection((host, int(port)), timeout=10)
            sent = (b"", HEADERS_HALF_SENT, BODY_HALF_SENT)[n % 3] if n % 100 else b""
            sock.sendall(sent)
            held.append((sock, sent))
        fastest = 10.0
        for _ in range(3):
            started = time.monotonic()
            assert httpx.get(f"{hub.url}/healthz", timeout=10).status_code == 200
            fastest = min(fastest, time.monotonic() - started)
        assert fastest < 1, f"/healthz took {fastest:.2f} s beside 2,000 half-sent requests"
        deadline = time.monotonic() + 60
        for sock, sent in held:
            answer = _read_to_eof(sock, deadline)
            if not sent:
                assert answer == b"", answer  # never said a word: just closed
                continue
            status, _, _ = answer.partition(b"\r\n")
            assert status == b"HTTP/1.1 408 Request Timeout", answer
            key = b"header_timeout_seconds" if sent == HEADERS_HALF_SENT else b"body_timeout"
            assert b'"field":"trace_server.' + key in answer, answer
    finally:
        for sock, _ in held:
            sock.close()
    with hub.client() as client:
        assert client.get("/v1/stats").json()["traces"] == 0
    assert "Traceback" not in hub.log and "unexpected error" not in hub.log


@pytest.mark.process
def test_a_slow_but_steady_body_is_read_and_headers_past_the_bound_are_refused(
    start_hub_process: Any, tmp_path: Path
) -> None:
    hub = start_hub_process({"storage_backend": "sqlite", "db_path": str(tmp_path / "t.db"),
                     "body_timeout_seconds": 2})
    host, port = hub.url.removeprefix("http://").split(":")
    body = b'{"trace_id": "slow", "task": "wait", "steps": []}'
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
                     b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
        # Each pause is under the bound, the whole is past it: the bound is on stalls.
        for piece in (body[:16], body[16:32], body[32:]):
            deadline = time.monotonic() + 1.2
            while time.monotonic() < deadline:  # the client's own pace, not a wait on the hub
                sock.settimeout(deadline - time.monotonic())
                try:
                    assert sock.recv(1) == b"", "the hub answered before the body was in"
                    raise AssertionError("the hub closed a request whose body was coming")
                except TimeoutError:
                    pass
            sock.sendall(piece)
        answer = _read_to_eof(sock, time.monotonic() + 30)
    assert answer.startswith(b"HTTP/1.1 202 "), answer
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n" + b"X-Filler: " + b"a" * 70_000)
        answer = _read_to_eof(sock, time.monotonic() + 30)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]


async def test_the_writes_of_one_turn_leave_in_one_send() -> None:
    """uvicorn writes a response's head, then its body: they leave together. A
    SOCK_SEQPACKET socket keeps each send() apart, so the peer sees how many there were."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # Told it is a stream socket, which asyncio requires; its sends keep their bounds.
    ours = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=ours.detach())
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.connect_accepted_socket(_Closing, ours)
    joined = _OneWritePerTurn(transport, loop)
    theirs.settimeout(10)
    with theirs:
        joined.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n")
        joined.write(b"done")
        assert joined.get_write_buffer_size() == 0  # the transport's own, passed through
        sent = loop.create_future()
        loop.call_soon(sent.set_result, None)  # runs after the turn's writes have left
        await sent
        assert theirs.recv(4096) == b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\ndone"
        # A large write goes at once (the transport's buffer limits then hold back a
        # streamed response), with what was held before it.
        large = b"x" * _JOINED_BYTES
        joined.write(b"head")
        joined.write(large)
        assert theirs.recv(2 * _JOINED_BYTES) == b"head" + large
        joined.write(b"last")
        joined.close()  # sends what it holds first
        await protocol.lost
        assert theirs.recv(4096) == b"last"
        assert theirs.recv(4096) == b""


class _Closing(asyncio.Protocol):
    def __init__(self) -> None:
        self.lost = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set_result(exc)


@pytest.mark.process
def test_pipelined_requests_are_answered_whole_and_in_order(
    start_hub_process: Any, tmp_path: Path
) -> None:
    hub = start_hub_process({"storage_backend": "sqlite", "db_path": str(tmp_path / "t.db")})
    host, port = hub.url.removeprefix("http://").split(":")
    body = b'{"trace_id": "piped", "task": "answer in order", "steps": []}'
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/traces HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            + b"GET /v1/traces/piped HTTP/1.1\r\nHost: localhost\r\n\r\n"
            + b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        )
        answer = _read_to_eof(sock, time.monotonic() + 30)
    stored, found, health = answer.split(b"HTTP/1.1 ")[1:]
    assert stored.startswith(b"202 ") and b'"trace_id":"piped"' in stored, stored
    assert found.startswith(b"200 ") and b'"task":"answer in order"' in found, found
    assert health.startswith(b"200 ") and health.endswith(b'{"status":"ok"}'), health
