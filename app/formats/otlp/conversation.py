"""One conversation out of many model calls, each of which repeats it so far.

Every convention is read into the same small model (`Message`, `Exchange` for one
model call, `ToolRun` for one tool execution); `one_conversation()` merges them:

- Exchanges in time order: a call's input messages at its start, its output messages
  at its end. A message is added unless the conversation already holds it, counted as
  a multiset: a call that repeats the history adds only what is new, and a message
  that really was said twice (the same text, the same call) stays twice.
- Tool runs pair with the model's calls: by the run's call id, else by order among the
  calls of its tool that no other run took (those with its arguments first). A result
  already in the conversation gets the run's error, a call without a result gets it
  right after the call. A run that pairs with no call is left out when the spans
  recorded the model's calls (code the model wrote calls tools it never called itself);
  when they recorded none (an agent span's input and output at most), each run becomes
  a call and its result at the time it ran.
"""

from __future__ import annotations

from collections import Counter, deque
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
    # A framework's rendering of calls a model made: it matches them, never adds one.
    rendered: bool = False
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
    # A model's call, not an agent invocation's summary of the run.
    model: bool = True


@dataclass(slots=True)
class ToolRun:
    start: int
    name: str
    call_id: str | None
    arguments: Any
    result: str | None
    error: str | None


def one_conversation(exchanges: list[Exchange], runs: list[ToolRun]) -> list[Message]:
    """In time linear in what the spans hold (docs/decisions.md: every parser is)."""
    merges = [(e.start, 0, e.inputs) for e in exchanges]
    merges += [(e.end, 1, e.outputs) for e in exchanges]
    merged = _Merged()
    for at, _, said in sorted(merges, key=lambda m: (m[0], m[1])):
        merged.add(said, at)
    return _paired(merged.systems, _answering(merged.rest), sorted(runs, key=lambda r: r.start),
                   runs_are_calls=not any(e.model for e in exchanges))


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


class _Merged:
    """The conversation so far: system instructions first, whenever a call first showed
    them, then the other messages in the order they were said."""

    def __init__(self) -> None:
        self.systems: list[Message] = []
        self.rest: list[Message] = []
        self._held: Counter[tuple[Any, ...]] = Counter()

    def add(self, said: list[Message], at: int) -> None:
        """A call's messages: each one the conversation holds is matched once (a
        multiset); the others are new. Kept up to date rather than counted again, so
        that each call costs its own messages only."""
        matched: Counter[tuple[Any, ...]] = Counter()
        for message in said:
            key = message.key()
            if self._held[key] > matched[key]:
                matched[key] += 1
                continue
            if message.rendered:
                continue
            message.at = at
            (self.systems if message.role == "system" else self.rest).append(message)
            # Held from now on, but not for this call: it said the message once.
            self._held[key] += 1
            matched[key] += 1


def _answering(said: list[Message]) -> list[Message]:
    """Each result tied to a call the model made: one without a call id answers the
    earliest call before it still without a result. One that answers no call the model
    made (a framework's own, such as the runs of a smolagents CodeAgent's code) is what
    the model was told, and stays so, as a user message."""
    asked: set[str] = set()
    waiting: deque[Call] = deque()
    answered: set[str] = set()
    out: list[Message] = []
    for message in said:
        if message.role == "assistant":
            waiting.extend(message.calls)
            asked.update(call.id for call in message.calls if call.id)
        elif message.role == "tool":
            if message.call_id is None:
                while waiting and waiting[0].id in answered:
                    waiting.popleft()
                if not waiting:
                    message = Message("user", text=message.text, at=message.at)
                else:
                    message.call_id = waiting.popleft().id
            elif message.call_id not in asked:
                message = Message("user", text=message.text, at=message.at)
            if message.call_id is not None:
                answered.add(message.call_id)
        out.append(message)
    return out


def _paired(systems: list[Message], said: list[Message], runs: list[ToolRun], *,
            runs_are_calls: bool) -> list[Message]:
    """The tool runs paired with the conversation, in run order: a result already
    there gets the run's error; a call without its result gets it after the call and
    the results that follow it. A run no call asked for is left out, unless
    `runs_are_calls` (no model call was recorded): then it becomes a call and its result
    where it happened in time (never between a call and its results)."""
    results: dict[str, Message] = {m.call_id: m for m in reversed(said)
                                   if m.role == "tool" and m.call_id}
    callers: dict[str, Message] = {}
    unclaimed = _Unclaimed()
    for message in said:
        for call in message.calls:
            if call.id:
                callers.setdefault(call.id, message)
                unclaimed.offer(call)
    claimed: set[str] = set()
    answers: dict[int, list[Message]] = {}  # id(a caller): results added after it
    timed: list[list[Message]] = []  # calls no model made, and their results, in time order
    for run in runs:
        call_id = run.call_id or unclaimed.take(run, claimed)
        if call_id is not None:
            claimed.add(call_id)
            if call_id in results:
                result = results[call_id]
                result.error = result.error or run.error
                continue
            if call_id in callers:
                caller = callers[call_id]
                results[call_id] = _result(run, call_id, caller.at)
                answers.setdefault(id(caller), []).append(results[call_id])
                continue
        if not runs_are_calls:
            continue
        asked = Message("assistant", calls=[Call(run.name, run.arguments, call_id)],
                        at=run.start)
        answered = _result(run, call_id, run.start)
        if call_id is not None:
            results[call_id] = answered
        timed.append([asked, answered])
    return systems + _woven(said, answers, timed)


def _woven(
    said: list[Message], answers: dict[int, list[Message]], timed: list[list[Message]]
) -> list[Message]:
    out: list[Message] = []
    pending = iter(timed)
    upcoming = next(pending, None)
    i = 0
    while i < len(said):
        # A call and the results that follow it stay together.
        unit = [said[i]]
        i += 1
        while i < len(said) and said[i].role == "tool":
            unit.append(said[i])
            i += 1
        while upcoming is not None and upcoming[0].at < unit[0].at:
            out += upcoming
            upcoming = next(pending, None)
        out += unit
        for message in unit:
            out += answers.get(id(message), ())
    while upcoming is not None:
        out += upcoming
        upcoming = next(pending, None)
    return out


class _Unclaimed:
    """The calls in the conversation, in order, for tool runs that do not carry their
    call id: each run takes the earliest call of its tool (with its arguments, when it
    has some) that no run has taken yet."""

    def __init__(self) -> None:
        self._by_name: dict[str, deque[str]] = {}
        self._by_arguments: dict[tuple[str, str], deque[str]] = {}

    def offer(self, call: Call) -> None:
        assert call.id is not None
        self._by_name.setdefault(call.name, deque()).append(call.id)
        key = (call.name, canonical(call.arguments))
        self._by_arguments.setdefault(key, deque()).append(call.id)

    def take(self, run: ToolRun, claimed: set[str]) -> str | None:
        """The call with the run's arguments, else the earliest of its tool: what an
        instrumentation records as a tool's input is often not what the model wrote
        (a wrapper's signature, a single argument's bare value)."""
        if run.arguments is not None:
            found = self._earliest(self._by_arguments.get((run.name, canonical(run.arguments))),
                                   claimed)
            if found is not None:
                return found
        return self._earliest(self._by_name.get(run.name), claimed)

    @staticmethod
    def _earliest(ids: deque[str] | None, claimed: set[str]) -> str | None:
        while ids:
            if ids[0] not in claimed:
                return ids[0]
            ids.popleft()  # taken by another run: never again
        return None


def _result(run: ToolRun, call_id: str | None, at: int) -> Message:
    return Message("tool", text=run.result, call_id=call_id, error=run.error, at=at)


def openai_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages, which the openai format reads into
    steps. A tool result holds what the model saw; its error goes beside it
    (`tool_errors`). A failed run whose result nobody recorded is written as
    OpenAI-style agents write one: "Error: ..."."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool":
            text = m.text or ""
            if m.error and not text.strip():
                text = f"Error: {m.error}"
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


def tool_errors(messages: list[Message]) -> list[str | None]:
    """The error of each tool result, in order: the steps' `error` beside the text."""
    return [m.error for m in messages if m.role == "tool"]
