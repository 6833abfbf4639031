"""A small fake OpenAI-compatible model endpoint, served by uvicorn on 127.0.0.1 in a
thread, speaking the real protocol with a Bearer key: `POST {prefix}/chat/completions`,
and the fine-tuning API: `POST {prefix}/files` (multipart), `POST/GET
{prefix}/fine_tuning/jobs` (list filtered by `metadata[k]=v`), `GET
{prefix}/fine_tuning/jobs/{id}`. A job moves validating_files -> running -> `job_outcome`
over `job_polls` GETs; an `Idempotency-Key` already seen answers the job it created.

Faults are scripted per request (`fake.faults.extend([...])`, consumed in order):
"401", "403", "404", "500", "502", "no_choices", "echo_key" (a 400 whose body
repeats the key, as some providers do), ("429", retry_after) and ("slow", seconds).
With no fault left, it answers with `fake.reply(request_json)`: the assistant's text,
or its whole message (tool calls, for an agent's turn). An outage is
`fake.down = fault`: every chat request meets that fault until it is set back to None
(("slow", 3600): the model hangs). `fake.delay` seconds pass before each answer that
succeeds (a slow model).

    fake = FakeModel(key="sk-test")
    with serve(fake) as base_url:   # http://127.0.0.1:PORT
        ...
"""

from __future__ import annotations

import asyncio
import email
import email.policy
import json
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.support.waiting import wait_until

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
    # The answer's text, or a whole assistant message (with tool_calls, say).
    reply: Callable[[dict[str, Any]], str | dict[str, Any]] = _summary
    faults: list[Fault] = field(default_factory=list)
    down: Fault | None = None
    delay: float = 0
    received: list[Received] = field(default_factory=list)
    # Chat requests being answered now, and the most there ever were at once.
    in_flight: int = 0
    most_in_flight: int = 0
    # Fine-tuning: uploaded files (id -> bytes), jobs (id -> job object), and how jobs end.
    files: dict[str, bytes] = field(default_factory=dict)
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    job_polls: int = 2
    job_outcome: str = "succeeded"
    _polls: dict[str, int] = field(default_factory=dict)
    _keys: dict[str, str] = field(default_factory=dict)

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self._handle, methods=["POST", "GET"])])

    def reset(self) -> None:
        """Back to a fresh server's state (one server serves a whole test module)."""
        fresh = FakeModel(key=self.key)
        for name in ("prefix", "reply", "faults", "down", "delay", "received", "in_flight",
                     "most_in_flight", "files", "jobs", "job_polls", "job_outcome", "_polls",
                     "_keys"):
            setattr(self, name, getattr(fresh, name))

    async def _handle(self, request: Request) -> Response:
        raw = await request.body()
        media = request.headers.get("content-type", "")
        if media.startswith("multipart/form-data"):
            body: dict[str, Any] = _multipart(media, raw)
        else:
            body = json.loads(raw) if raw else {}
        self.received.append(Received(request.url.path, dict(request.headers), body))
        path = request.url.path
        if not path.startswith(f"{self.prefix}/"):
            return _error(404, "not_found", f"no route {path}")
        route = path[len(self.prefix) + 1 :]
        if route != "chat/completions" and not route.startswith(("files", "fine_tuning/jobs")):
            return _error(404, "not_found", f"no route {path}")
        if request.headers.get("authorization") != f"Bearer {self.key}":
            return _error(401, "invalid_api_key", "Incorrect API key provided")
        if route != "chat/completions":
            return self._fine_tuning(request, route, body)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        counted = self.received  # a reset() since (the next test) starts a new count
        try:
            return await self._chat(body)
        finally:
            if self.received is counted:
                self.in_flight -= 1

    def chats(self) -> list[Received]:
        return [r for r in self.received if r.path.endswith("/chat/completions")]

    async def _chat(self, body: dict[str, Any]) -> Response:
        fault = self.faults.pop(0) if self.faults else self.down
        if fault == "echo_key":
            return _error(400, "invalid_request", f"bad request for key {self.key}")
        if fault is not None:
            return await _fault(fault)
        if self.delay:
            await asyncio.sleep(self.delay)
        said = self.reply(body)
        message = said if isinstance(said, dict) else {"role": "assistant", "content": said}
        return JSONResponse(
            {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "model": body.get("model") or self.model,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                    }
                ],
                "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
            }
        )


    def _fine_tuning(self, request: Request, route: str, body: dict[str, Any]) -> Response:
        key = request.headers.get("idempotency-key")
        if route == "files" and request.method == "POST":
            file_id = f"file-{len(self.files) + 1}"
            self.files[file_id] = body["file"]
            return JSONResponse({"id": file_id, "object": "file", "purpose": body.get("purpose"),
                                 "bytes": len(body["file"]), "filename": body.get("filename")})
        if route == "fine_tuning/jobs" and request.method == "POST":
            if key and key in self._keys:
                return JSONResponse(self.jobs[self._keys[key]])
            if body.get("training_file") not in self.files:
                return _error(400, "invalid_file", f"no file {body.get('training_file')}")
            job_id = f"ftjob-{len(self.jobs) + 1}"
            self.jobs[job_id] = {
                "id": job_id, "object": "fine_tuning.job", "model": body["model"],
                "status": "validating_files", "fine_tuned_model": None,
                "training_file": body["training_file"],
                "hyperparameters": body.get("hyperparameters"),
                "metadata": body.get("metadata"), "suffix": body.get("suffix"), "error": None,
            }
            if key:
                self._keys[key] = job_id
            return JSONResponse(self.jobs[job_id])
        if route == "fine_tuning/jobs":
            wanted = {k[len("metadata["):-1]: v for k, v in request.query_params.items()
                      if k.startswith("metadata[")}
            found = [j for j in self.jobs.values()
                     if all((j.get("metadata") or {}).get(k) == v for k, v in wanted.items())]
            return JSONResponse({"object": "list", "data": found, "has_more": False})
        job = self.jobs.get(route.rsplit("/", 1)[-1])
        if job is None:
            return _error(404, "not_found", f"no job at {route}")
        polls = self._polls[job["id"]] = self._polls.get(job["id"], 0) + 1
        if job["status"] not in ("succeeded", "failed", "cancelled"):
            job["status"] = "running" if polls < self.job_polls else self.job_outcome
            if job["status"] == "succeeded":
                job["fine_tuned_model"] = f"ft:{job['model']}:{job['suffix']}"
            elif job["status"] == "failed":
                job["error"] = {"code": "invalid_training_file", "message": "scripted failure"}
        return JSONResponse(job)


def _multipart(content_type: str, raw: bytes) -> dict[str, Any]:
    """Form fields as text, the file field as bytes (and its name under `filename`)."""
    message = email.message_from_bytes(
        f"Content-Type: {content_type}\r\n\r\n".encode() + raw, policy=email.policy.HTTP
    )
    fields: dict[str, Any] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        data = part.get_payload(decode=True) or b""
        if part.get_filename():
            fields[str(name)] = data
            fields["filename"] = part.get_filename()
        else:
            fields[str(name)] = data.decode() if isinstance(data, bytes) else str(data)
    return fields


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


class Servable(Protocol):
    """A fake server: its ASGI app."""

    def app(self) -> Any: ...


@contextmanager
def serve(fake: Servable) -> Iterator[str]:
    """Run `fake` on 127.0.0.1 (a free port) in a thread; yields its root URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(fake.app(), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 30, what="the fake server")
        if not server.started:
            raise RuntimeError("fake model server did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()
