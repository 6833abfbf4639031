"""A captured call: what the gateway stores for each model call, built from the request
and the upstream's answer (whole, or assembled from a stream as it passes through).

The record (gateway_calls.call) holds the request as the agent sent it and the answer
as the upstream gave it, plus what a trajectory reads without parsing them again:

    {"kind": "chat" | "completion" | "responses", "stream", "model" (asked for),
     "upstream_model" (sent), "answered_by" (the answer's model), "request", "response",
     "status", "error", "latency_ms", "first_byte_ms", "usage", "finish_reason",
     "prompt_token_ids", "token_ids", "logprobs" (of choice 0), "policy_version",
     "disconnected", "redactions", "tokens_withheld"}

Token ids and logprobs are those of the first choice, as vLLM returns them with
`return_token_ids` and `logprobs`: `prompt_token_ids` at the top level (chat) or on
the choice (completions), `choices[].token_ids`, and logprobs as
`logprobs.content[].logprob` (chat) or `logprobs.token_logprobs` (completions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["chat", "completion", "responses"]


@dataclass(slots=True)
class StreamAssembly:
    """The answer of a stream, gathered chunk by chunk (each a parsed SSE `data:`
    event): the choices' text, reasoning and tool calls, token ids and logprobs across
    chunks, and the usage of the trailing chunk."""

    kind: Kind
    head: dict[str, Any] = field(default_factory=dict)  # id, model, created, ...
    choices: dict[int, dict[str, Any]] = field(default_factory=dict)
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)  # responses: kept as sent

    def add(self, chunk: Any) -> bool:
        """Gather one chunk; True when it ends (a choice's) answer: a finish_reason,
        the usage, or a Responses API `response.completed`."""
        if not isinstance(chunk, dict):
            return False
        if self.kind == "responses":
            self.events.append(chunk)
            return str(chunk.get("type", "")).startswith(("response.completed",
                                                           "response.failed",
                                                           "response.incomplete"))
        for key in ("id", "model", "created", "system_fingerprint"):
            if key in chunk and key not in self.head:
                self.head[key] = chunk[key]
        if isinstance(chunk.get("prompt_token_ids"), list):
            self.prompt_token_ids = chunk["prompt_token_ids"]
        ends = False
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
            ends = True
        for raw in chunk.get("choices") or []:
            if not isinstance(raw, dict):
                continue
            choice = self.choices.setdefault(int(raw.get("index", 0)), _empty(self.kind))
            self._choice(choice, raw)
            if raw.get("finish_reason") is not None:
                choice["finish_reason"] = raw["finish_reason"]
                ends = True
        return ends

    def _choice(self, choice: dict[str, Any], raw: dict[str, Any]) -> None:
        if isinstance(raw.get("token_ids"), list):
            choice["token_ids"].extend(raw["token_ids"])
        if isinstance(raw.get("prompt_token_ids"), list):
            choice["prompt_token_ids"] = raw["prompt_token_ids"]
        logprobs = raw.get("logprobs")
        if isinstance(logprobs, dict):
            _add_logprobs(choice["logprobs"], logprobs)
        if self.kind == "completion":
            choice["text"] += str(raw.get("text") or "")
            return
        delta = _dict(raw.get("delta"))
        message = choice["message"]
        if delta.get("role"):
            message["role"] = delta["role"]
        for key in ("content", "reasoning_content", "reasoning", "refusal"):
            if isinstance(delta.get(key), str):
                message[key] = (message.get(key) or "") + delta[key]
        for call in delta.get("tool_calls") or []:
            if not isinstance(call, dict):
                continue
            calls = message.setdefault("tool_calls", [])
            index = int(call.get("index", len(calls)))
            while len(calls) <= index:
                calls.append({"id": None, "type": "function",
                              "function": {"name": "", "arguments": ""}})
            into = calls[index]
            if call.get("id"):
                into["id"] = call["id"]
            fn = _dict(call.get("function"))
            if fn.get("name"):
                into["function"]["name"] += fn["name"]
            if isinstance(fn.get("arguments"), str):
                into["function"]["arguments"] += fn["arguments"]

    def response(self) -> dict[str, Any]:
        """The answer as the upstream would have sent it whole."""
        if self.kind == "responses":
            done = next((e.get("response") for e in reversed(self.events)
                         if isinstance(e.get("response"), dict)), None)
            return done if done is not None else {"events": self.events}
        choices = []
        for index in sorted(self.choices):
            choice = dict(self.choices[index])
            choice["index"] = index
            if not choice["token_ids"]:
                del choice["token_ids"]
            if not any(choice["logprobs"].values()):
                choice["logprobs"] = None
            choices.append(choice)
        body: dict[str, Any] = {
            **self.head,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "choices": choices,
        }
        if self.prompt_token_ids is not None:
            body["prompt_token_ids"] = self.prompt_token_ids
        if self.usage is not None:
            body["usage"] = self.usage
        return body


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _empty(kind: Kind) -> dict[str, Any]:
    base: dict[str, Any] = {"finish_reason": None, "token_ids": [],
                            "logprobs": {"content": [], "token_logprobs": []}}
    if kind == "completion":
        return {**base, "text": ""}
    return {**base, "message": {"role": "assistant", "content": None}}


def _add_logprobs(into: dict[str, list[Any]], logprobs: dict[str, Any]) -> None:
    for key in ("content", "token_logprobs"):
        if isinstance(logprobs.get(key), list):
            into[key].extend(logprobs[key])


def record(
    kind: Kind,
    request: dict[str, Any],
    *,
    upstream_model: str | None,
    status: int,
    response: Any,
    error: Any = None,
    latency_ms: float,
    first_byte_ms: float | None = None,
    stream: bool = False,
    disconnected: bool = False,
    policy_version: str | None = None,
) -> dict[str, Any]:
    """The capture of one call. `response`: the upstream's answer (a JSON object) when
    it answered 2xx; `error`: its error body (or the hub's account of a transport
    failure) otherwise."""
    answer = response if isinstance(response, dict) else {}
    choices = answer.get("choices") if isinstance(answer.get("choices"), list) else []
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    prompt_ids = answer.get("prompt_token_ids")
    if prompt_ids is None:
        prompt_ids = first.get("prompt_token_ids")
    token_ids = first.get("token_ids")
    return {
        "kind": kind,
        "stream": stream,
        "model": request.get("model"),
        "upstream_model": upstream_model,
        "answered_by": answer.get("model"),
        "request": request,
        "response": response,
        "status": status,
        "error": error,
        "latency_ms": round(latency_ms, 3),
        "first_byte_ms": None if first_byte_ms is None else round(first_byte_ms, 3),
        "usage": answer.get("usage"),
        "finish_reason": first.get("finish_reason") or _responses_status(kind, answer),
        "prompt_token_ids": prompt_ids if _ids(prompt_ids) else None,
        "token_ids": token_ids if _ids(token_ids) else None,
        "logprobs": _logprobs(first.get("logprobs")),
        "policy_version": policy_version,
        "disconnected": disconnected,
        "redactions": {},
        "tokens_withheld": None,
    }


def answer_message(call: dict[str, Any]) -> dict[str, Any] | None:
    """The assistant message of a chat call's first choice; None for other calls or
    when there was no answer."""
    if call["kind"] != "chat" or not isinstance(call.get("response"), dict):
        return None
    choices = call["response"].get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    message = choices[0].get("message")
    return message if isinstance(message, dict) else None


def _responses_status(kind: Kind, answer: dict[str, Any]) -> str | None:
    status = answer.get("status") if kind == "responses" else None
    return status if isinstance(status, str) else None


def _ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) for i in value)


def _logprobs(value: Any) -> list[float | None] | None:
    """The chosen tokens' logprobs, one per generated token."""
    if not isinstance(value, dict):
        return None
    content = value.get("content")
    if isinstance(content, list) and content:
        return [item.get("logprob") if isinstance(item, dict) else None for item in content]
    token_logprobs = value.get("token_logprobs")
    if isinstance(token_logprobs, list) and token_logprobs:
        return list(token_logprobs)
    return None
