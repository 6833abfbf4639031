"""One conversation out of many model calls, each of which repeats it so far.

Every convention is read into the same small model (`Message`, `Exchange` for one
model call, `ToolRun` for one tool execution); `one_conversation()` merges them:

- Exchanges in time order: a call's input messages at its start, its output messages
  at its end. A message is added unless the conversation already holds it, counted as
  a multiset: a call that repeats the history adds only what is new, and a message
  that really was said twice (the same text, the same call) stays twice.
- Tool runs pair with the calls by call id: a result already in the conversation gets
  the run's error, a call without a result gets it right after the call, and a run
  that no model call asked for (or with no id that matches) becomes a call and its
  result at the time it ran.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "model": "assistant",
    "ai": "assistant",
    "tool": "tool",
    "function": "tool",
    "ipython": "tool",
}


@dataclass(slots=True)
class Call:
    name: str
    arguments: Any  # a JSON value, or the text the model wrote
    id: str | None = None


@dataclass(slots=True)
class Message:
    role: str  # system, user, assistant or tool
    text: str | None = None
    reasoning: str | None = None
    calls: list[Call] = field(default_factory=list)
    call_id: str | None = None  # a tool result: the call it answers
    error: str | None = None  # a tool result that failed: why
    at: int = 0  # when it entered the conversation (ns)
    _key: tuple[Any, ...] | None = None

    def key(self) -> tuple[Any, ...]:
        """What makes two messages the same one, whichever convention carried them."""
        if self._key is None:
            calls = tuple((c.id or "", c.name, canonical(c.arguments)) for c in self.calls)
            self._key = (self.role, (self.text or "").strip(), calls, self.call_id or "")
        return self._key


@dataclass(slots=True)
class Exchange:
    """One model call: what it was sent and what it answered."""

    start: int
    end: int
    inputs: list[Message]
    outputs: list[Message]


@dataclass(slots=True)
class ToolRun:
    start: int
    name: str
    call_id: str | None
    arguments: Any
    result: str | None
    error: str | None


def one_conversation(exchanges: list[Exchange], runs: list[ToolRun]) -> list[Message]:
    merges = [(e.start, 0, e.inputs) for e in exchanges]
    merges += [(e.end, 1, e.outputs) for e in exchanges]
    messages: list[Message] = []
    for at, _, said in sorted(merges, key=lambda m: (m[0], m[1])):
        _merge(messages, said, at)
    claimed: set[str] = set()
    for run in sorted(runs, key=lambda r: r.start):
        _pair(messages, run, claimed)
    return messages


def canonical(arguments: Any) -> str:
    """Tool-call arguments compared as JSON, whether sent as an object or as text."""
    if isinstance(arguments, str):
        text = arguments
        try:
            arguments = orjson.loads(text)
        except orjson.JSONDecodeError:
            return text.strip()
    try:
        return orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS).decode()
    except (orjson.JSONEncodeError, TypeError):
        return repr(arguments)


def text_of(value: Any) -> str | None:
    """A value said as text: a string as it is, anything else as compact JSON."""
    if value is None or isinstance(value, str):
        return value
    try:
        return orjson.dumps(value).decode()
    except (orjson.JSONEncodeError, TypeError):
        return str(value)


def _merge(messages: list[Message], said: list[Message], at: int) -> None:
    held = Counter(m.key() for m in messages)
    for message in said:
        key = message.key()
        if held[key]:
            held[key] -= 1
            continue
        message.at = at
        if message.role == "system":
            # System instructions come first, whenever a call first showed them.
            leading = next((i for i, m in enumerate(messages) if m.role != "system"),
                           len(messages))
            messages.insert(leading, message)
        else:
            messages.append(message)


def _pair(messages: list[Message], run: ToolRun, claimed: set[str]) -> None:
    call_id = run.call_id or _call_of(messages, run, claimed)
    if call_id is not None:
        claimed.add(call_id)
        for message in messages:
            if message.role == "tool" and message.call_id == call_id:
                message.error = message.error or run.error
                return
        for i, message in enumerate(messages):
            if any(call.id == call_id for call in message.calls):
                after = i + 1
                while after < len(messages) and messages[after].role == "tool":
                    after += 1
                messages.insert(after, _result(run, call_id, message.at))
                return
    # No model call asked for it: the call and its result, where they happened in time.
    where = bisect.bisect_right([m.at for m in messages], run.start)
    call = Message("assistant", calls=[Call(run.name, run.arguments, call_id)], at=run.start)
    messages[where:where] = [call, _result(run, call_id, run.start)]


def _call_of(messages: list[Message], run: ToolRun, claimed: set[str]) -> str | None:
    """For a run that does not carry its call id: the id of the earliest call of this
    tool, with these arguments, that no other run has claimed."""
    wanted = canonical(run.arguments) if run.arguments is not None else None
    for message in messages:
        for call in message.calls:
            if (call.id and call.id not in claimed and call.name == run.name
                    and (wanted is None or canonical(call.arguments) == wanted)):
                return call.id
    return None


def _result(run: ToolRun, call_id: str | None, at: int) -> Message:
    return Message("tool", text=run.result, call_id=call_id, error=run.error, at=at)


def openai_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages, which the openai format reads into
    steps. A failed tool result is written as OpenAI-style agents write one:
    "Error: ..." (the openai format reads that prefix as the step's error)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool":
            text = m.text or ""
            if m.error and not text.lstrip().lower().startswith("error:"):
                text = f"Error: {m.error}" + (f"\n{text}" if text else "")
            out.append({"role": "tool", "tool_call_id": m.call_id, "content": text})
            continue
        message: dict[str, Any] = {"role": m.role, "content": m.text}
        if m.reasoning:
            message["reasoning_content"] = m.reasoning
        if m.calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
                for call in m.calls
            ]
        out.append(message)
    return out
