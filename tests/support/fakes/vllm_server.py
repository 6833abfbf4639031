"""A small vLLM-like model server on 127.0.0.1, for the gateway: `POST
{prefix}/chat/completions` (plain and `stream: true`), `POST {prefix}/completions`, `GET
{prefix}/models`, with a Bearer key. As vLLM does, it returns `prompt_token_ids` and
`choices[].token_ids` when the request carries `return_token_ids: true`, and logprobs
with `logprobs: true` (chat: `logprobs.content[]`; completions: `logprobs.token_logprobs`).

Its tokenizer and chat template are tiny and consistent, as a real model's are: a
message is its role's special token, one id per character of its text (an assistant's
tool calls as their JSON), and an end token; a prompt is the messages and the
assistant's role token; a completion is the answer's characters and the end token. So
an agent that resends its history unchanged gets prompt ids that begin with the
previous call's prompt and completion ids.

Faults are scripted per request (`fake.faults.append(...)`, consumed in order):
("429", retry_after), "500", ("hang", seconds) (no answer until then), ("cut", n) (a
stream that breaks after n chunks). `fake.reply(body)` is the answer: text, or an
assistant message with tool calls. `fake.chunk_delay` paces a stream.

    python -m tests.support.fakes.vllm_server PORT   # for bench/gateway.py
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.support.waiting import wait_until

ROLES = {"system": 100000, "user": 100001, "assistant": 100002, "tool": 100003}
END = 100010
Fault = str | tuple[str, float]


def text_ids(text: str) -> list[int]:
    return [ord(ch) for ch in text]


def rendered(message: dict[str, Any]) -> str:
    """What the template shows of a message: its text, and its tool calls as JSON."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    text = content or ""
    calls = message.get("tool_calls") or []
    if calls:
        text += json.dumps([[c["function"]["name"], c["function"]["arguments"]]
                            for c in calls])
    return text


def prompt_ids(messages: list[dict[str, Any]]) -> list[int]:
    ids: list[int] = []
    for m in messages:
        ids += [ROLES.get(m.get("role", "user"), ROLES["user"]), *text_ids(rendered(m)), END]
    return [*ids, ROLES["assistant"]]


def logprob(position: int) -> float:
    return -0.01 * (position % 7 + 1)


def agent_reply(body: dict[str, Any]) -> str | dict[str, Any]:
    """Calls the first tool offered once, then answers."""
    messages = body.get("messages") or []
    tools = body.get("tools") or []
    if tools and not any(m.get("role") == "tool" for m in messages):
        name = tools[0]["function"]["name"]
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{len(messages)}", "type": "function",
             "function": {"name": name, "arguments": '{"path": "README.md"}'}}]}
    return "The answer is 42."


@dataclass
class FakeVllm:
    key: str = "sk-upstream"
    prefix: str = "/v1"
    model: str = "fake-policy"
    reply: Callable[[dict[str, Any]], str | dict[str, Any]] = agent_reply
    faults: list[Fault] = field(default_factory=list)
    chunk_delay: float = 0.0
    answer_delay: float = 0.0  # a model's time to answer, before anything is sent
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    keep: bool = True  # record requests (off for the bench)
    streams_ended: int = 0  # streams whose last byte was sent

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route(f"{self.prefix}/chat/completions", self._chat, methods=["POST"]),
            Route(f"{self.prefix}/completions", self._completions, methods=["POST"]),
            Route(f"{self.prefix}/responses", self._responses, methods=["POST"]),
            Route(f"{self.prefix}/models", self._models, methods=["GET"]),
        ])

    def reset(self) -> None:
        self.reply, self.faults, self.chunk_delay = agent_reply, [], 0.0
        self.answer_delay = 0.0
        self.received, self.headers = [], []
        self.streams_ended = 0

    async def _admit(self, request: Request) -> tuple[dict[str, Any], Response | None]:
        body = orjson.loads(await request.body()) if request.method == "POST" else {}
        if self.keep:
            self.received.append(body)
            self.headers.append(dict(request.headers))
        if request.headers.get("authorization") != f"Bearer {self.key}":
            return body, _error(401, "Incorrect API key provided")
        fault = self.faults.pop(0) if self.faults else None
        if fault is None or (isinstance(fault, tuple) and fault[0] == "cut"):
            if self.answer_delay:
                await asyncio.sleep(self.answer_delay)
            if fault is not None:
                body["_cut"] = int(fault[1])
            return body, None
        name, arg = fault if isinstance(fault, tuple) else (fault, 0.0)
        if name == "hang":
            await asyncio.sleep(arg)
            return body, _error(500, "hung, then failed")
        if name == "429":
            return body, _error(429, "Rate limit reached", {"Retry-After": f"{arg:g}"})
        return body, _error(int(name), f"scripted {name}")

    async def _models(self, request: Request) -> Response:
        _, refused = await self._admit(request)
        if refused is not None:
            return refused
        return _json({"object": "list", "data": [{"id": self.model, "object": "model",
                                                   "owned_by": "vllm"}]})

    async def _chat(self, request: Request) -> Response:
        body, refused = await self._admit(request)
        if refused is not None:
            return refused
        said = self.reply(body)
        message = said if isinstance(said, dict) else {"role": "assistant", "content": said}
        prompt = prompt_ids(body.get("messages") or [])
        completion = [*text_ids(rendered(message)), END]
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        head = {"id": "chatcmpl-fake", "created": 1, "model": body.get("model") or self.model}
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(completion),
                 "total_tokens": len(prompt) + len(completion)}
        ids = bool(body.get("return_token_ids"))
        wants_logprobs = bool(body.get("logprobs"))
        start = len(prompt)
        if body.get("stream"):
            return StreamingResponse(
                self._chat_stream(body, head, message, prompt, completion, finish, usage),
                media_type="text/event-stream")
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
        if ids:
            choice["token_ids"] = completion
        if wants_logprobs:
            choice["logprobs"] = {"content": [
                _token_logprob(t, start + j) for j, t in enumerate(completion)]}
        answer = {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
        if ids:
            answer["prompt_token_ids"] = prompt
        return _json(answer)

    async def _chat_stream(self, body: dict[str, Any], head: dict[str, Any],
                           message: dict[str, Any], prompt: list[int], completion: list[int],
                           finish: str, usage: dict[str, Any]) -> AsyncIterator[bytes]:
        ids = bool(body.get("return_token_ids"))
        wants_logprobs = bool(body.get("logprobs"))
        base = {**head, "object": "chat.completion.chunk"}
        first: dict[str, Any] = {**base, "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        if ids:
            first["prompt_token_ids"] = prompt
        yield _event(first)
        text = message.get("content") or ""
        pieces: list[tuple[dict[str, Any], list[int]]] = []
        for i in range(0, len(text), 4):
            pieces.append(({"content": text[i:i + 4]}, text_ids(text[i:i + 4])))
        for k, call in enumerate(message.get("tool_calls") or []):
            fn = call["function"]
            rendered_ids = text_ids(rendered({"tool_calls": [call]}))
            pieces.append(({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                            "function": {"name": fn["name"],
                                                         "arguments": fn["arguments"]}}]},
                           rendered_ids))
        position = len(prompt)
        sent = 0
        for n, (delta, piece_ids) in enumerate(pieces):
            if "_cut" in body and n >= body["_cut"]:
                raise ConnectionResetError("the stream was cut")  # uvicorn drops it
            last = n == len(pieces) - 1
            piece_ids = [*piece_ids, END] if last else piece_ids
            choice: dict[str, Any] = {"index": 0, "delta": delta,
                                      "finish_reason": finish if last else None}
            if ids:
                choice["token_ids"] = piece_ids
            if wants_logprobs:
                choice["logprobs"] = {"content": [
                    _token_logprob(t, position + j) for j, t in enumerate(piece_ids)]}
            position += len(piece_ids)
            sent += len(piece_ids)
            if self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)
            yield _event({**base, "choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            yield _event({**base, "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"
        self.streams_ended += 1

    async def _completions(self, request: Request) -> Response:
        body, refused = await self._admit(request)
        if refused is not None:
            return refused
        prompt_text = body.get("prompt")
        if isinstance(prompt_text, list):
            prompt_text = prompt_text[0]
        prompt = text_ids(str(prompt_text))
        said = self.reply({"prompt": prompt_text})
        text = said if isinstance(said, str) else str(said.get("content") or "")
        completion = [*text_ids(text), END]
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": "stop"}
        if body.get("return_token_ids"):
            choice.update(prompt_token_ids=prompt, token_ids=completion)
        if body.get("logprobs") is not None:
            choice["logprobs"] = {"tokens": [str(t) for t in completion],
                                  "token_logprobs": [logprob(len(prompt) + j)
                                                     for j in range(len(completion))],
                                  "top_logprobs": None, "text_offset": None}
        n = int(body.get("n") or 1)
        return _json({"id": "cmpl-fake", "object": "text_completion", "created": 1,
                      "model": body.get("model") or self.model,
                      "choices": [{**choice, "index": i} for i in range(n)],
                      "usage": {"prompt_tokens": len(prompt),
                                "completion_tokens": len(completion),
                                "total_tokens": len(prompt) + len(completion)}})

    async def _responses(self, request: Request) -> Response:
        """The Responses API: the reply as one output message, whole or streamed."""
        body, refused = await self._admit(request)
        if refused is not None:
            return refused
        said = self.reply({"messages": [{"role": "user", "content": body.get("input")}]})
        text = said if isinstance(said, str) else str(said.get("content") or "")
        message = {"type": "message", "id": "msg-fake", "role": "assistant",
                   "status": "completed",
                   "content": [{"type": "output_text", "text": text, "annotations": []}]}
        answer = {"id": "resp-fake", "object": "response", "created_at": 1,
                  "status": "completed", "model": body.get("model") or self.model,
                  "output": [message],
                  "usage": {"input_tokens": 3, "output_tokens": len(text_ids(text)),
                            "total_tokens": 3 + len(text_ids(text))}}
        if body.get("stream"):
            return StreamingResponse(self._responses_stream(answer, message, text),
                                     media_type="text/event-stream")
        return _json(answer)

    async def _responses_stream(self, answer: dict[str, Any], message: dict[str, Any],
                                text: str) -> AsyncIterator[bytes]:
        """The events OpenAI streams for one output message, each `event:` + `data:`."""
        begun = {**answer, "status": "in_progress", "output": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        item = {"item_id": message["id"], "output_index": 0, "content_index": 0}
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": begun},
            {"type": "response.in_progress", "response": begun},
            {"type": "response.output_item.added", "output_index": 0,
             "item": {**message, "status": "in_progress", "content": []}},
            {"type": "response.content_part.added", **item, "part": part},
            *({"type": "response.output_text.delta", **item, "delta": text[i:i + 4],
               "logprobs": []} for i in range(0, len(text), 4)),
            {"type": "response.output_text.done", **item, "text": text, "logprobs": []},
            {"type": "response.content_part.done", **item, "part": {**part, "text": text}},
            {"type": "response.output_item.done", "output_index": 0, "item": message},
            {"type": "response.completed", "response": answer},
        ]
        for n, event in enumerate(events):
            yield (f"event: {event['type']}\n").encode() + _event(
                {**event, "sequence_number": n})


def _token_logprob(token: int, position: int) -> dict[str, Any]:
    text = "<|end|>" if token == END else chr(token)
    return {"token": text, "logprob": logprob(position), "bytes": list(text.encode()),
            "top_logprobs": []}


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _json(body: dict[str, Any]) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps({"error": {"message": message, "type": "fault",
                                            "code": status}}),
                    status, headers, media_type="application/json")


@contextmanager
def serve(fake: FakeVllm) -> Iterator[str]:
    """Run `fake` on 127.0.0.1 (a free port) in a thread; yields its base URL (…/v1)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fake.app(), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 30, what="the fake vLLM")
        yield f"http://127.0.0.1:{port}{fake.prefix}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()


if __name__ == "__main__":
    # PORT [ANSWER_MS]
    delay = float(sys.argv[2]) / 1000 if len(sys.argv) > 2 else 0.0
    uvicorn.run(FakeVllm(keep=False, answer_delay=delay).app(), host="127.0.0.1",
                port=int(sys.argv[1]),
                log_level="warning", access_log=False)
