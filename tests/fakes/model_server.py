"""A small fake OpenAI-compatible model endpoint, served by uvicorn on 127.0.0.1 in a
thread, speaking the real protocol: `POST {prefix}/chat/completions` with a Bearer key.

Faults are scripted per request (`fake.faults.extend([...])`, consumed in order):
"401", "403", "404", "500", "502", "no_choices", "echo_key" (a 400 whose body
repeats the key, as some providers do), ("429", retry_after) and ("slow", seconds). With no fault left, it answers with `fake.reply(request_json)`.

    fake = FakeModel(key="sk-test")
    with serve(fake) as base_url:   # http://127.0.0.1:PORT
        ...
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

Fault = str | tuple[str, float]


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


def _summary(body: dict[str, Any]) -> str:
    return "[CONTEXT SUMMARY]: the agent explored the repository and ran the build."


@dataclass
class FakeModel:
    key: str = "sk-test-key"
    prefix: str = "/v1"
    model: str = "fake-model"
    reply: Callable[[dict[str, Any]], str] = _summary
    faults: list[Fault] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self._handle, methods=["POST", "GET"])])

    async def _handle(self, request: Request) -> Response:
        body = await request.json() if request.method == "POST" else {}
        self.received.append(Received(request.url.path, dict(request.headers), body))
        if request.url.path != f"{self.prefix}/chat/completions":
            return _error(404, "not_found", f"no route {request.url.path}")
        if request.headers.get("authorization") != f"Bearer {self.key}":
            return _error(401, "invalid_api_key", "Incorrect API key provided")
        fault = self.faults.pop(0) if self.faults else None
        if fault == "echo_key":
            return _error(400, "invalid_request", f"bad request for key {self.key}")
        if fault is not None:
            return await _fault(fault)
        return JSONResponse(
            {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "model": self.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": self.reply(body)},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
            }
        )


async def _fault(fault: Fault) -> Response:
    name, arg = fault if isinstance(fault, tuple) else (fault, 0.0)
    if name == "slow":
        await asyncio.sleep(arg)
        return _error(500, "server_error", "slow and then failed")
    if name == "429":
        return _error(429, "rate_limited", "slow down", {"Retry-After": f"{arg:g}"})
    if name == "no_choices":
        return JSONResponse({"id": "x", "object": "chat.completion", "error": "upstream hiccup"})
    return _error(int(name), "fault", f"scripted {name}")


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse({"error": {"code": code, "message": message}}, status, headers)


@contextmanager
def serve(fake: FakeModel) -> Iterator[str]:
    """Run `fake` on 127.0.0.1 (a free port) in a thread; yields its root URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(fake.app(), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("fake model server did not start")
            threading.Event().wait(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()
