"""Helpers the source adapters share: the adapter protocol, step constructors,
chat-message and ReAct-text conversion, and status tables.

Conventions every adapter follows, so that scoring sees the same shapes:
- the task is the opening user request; it is not repeated as a step;
- an action's `arguments` is a JSON object when the source gives one, text commands
  become `{"command": ...}`, and only what the agent really wrote malformed stays a
  raw string (so `invalid_tool_call` fires on real mistakes only);
- an observation's `error` is set only when the source itself marks a tool error;
  exit codes go to `exit_code` and are not errors by themselves;
- patches and other run artefacts go to metadata; a `final` step is the agent's own
  final answer.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import orjson

from app.domain import Outcome, Status, Step, StepType, Trace


class Unusable(ValueError):
    """A record that decodes but holds no trajectory this adapter can use; the reader
    reports it as Unreadable with this message as the reason."""


class Adapter(Protocol):
    """One source format. Modules implement it with module-level names."""

    NAME: str

    def looks_like(self, obj: Any) -> bool: ...

    def parse(self, obj: Any) -> Iterator[Trace]: ...


def env_reward(value: Any) -> float | None:
    """A source's reward as the environment's reward (`Outcome.reward`): a finite
    number, else None (a source that wrote something else sent no usable reward)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


# -- steps -------------------------------------------------------------------------


def thought(text: str) -> Step:
    return Step(type=StepType.THOUGHT, content=text)


def message(role: str, text: str) -> Step:
    return Step(type=StepType.MESSAGE, role=role, content=text)


def action(tool: str | None, arguments: Any, call_id: str | None = None) -> Step:
    return Step(type=StepType.ACTION, tool=tool, arguments=arguments, call_id=call_id)


def observation(
    content: str,
    *,
    call_id: str | None = None,
    error: str | None = None,
    exit_code: int | None = None,
) -> Step:
    return Step(
        type=StepType.OBSERVATION,
        content=content,
        call_id=call_id,
        error=error,
        exit_code=exit_code,
    )


def final(text: str) -> Step:
    return Step(type=StepType.FINAL, content=text)


def command_action(command: str, call_id: str | None = None, *, tool: str | None = None) -> Step:
    """A text command (`open fridge 1`, `find_file x.py`): the tool is its first word,
    unless the source names one, and the whole command is the argument."""
    command = command.strip()
    name = tool if tool is not None else (command.split(maxsplit=1) or [""])[0]
    return action(name, {"command": command}, call_id)


class CallIds:
    """Sequential call ids for sources that do not give any, so that an observation
    still points at the action it answers."""

    def __init__(self, prefix: str = "call") -> None:
        self._prefix = prefix
        self._count = 0
        self.last: str | None = None

    def new(self) -> str:
        self._count += 1
        self.last = f"{self._prefix}_{self._count}"
        return self.last


# -- values ------------------------------------------------------------------------


def text_of(content: Any) -> str:
    """Message content as text: a string, a list of `{type: text, text}` parts, or None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(part.get("text", "")) if isinstance(part, dict) else str(part) for part in content
        )
    return orjson.dumps(content).decode()


def parse_arguments(raw: Any) -> Any:
    """Tool arguments as a JSON object when they are (or encode) one; otherwise the raw
    value, so that a malformed call stays visible as such."""
    if isinstance(raw, str):
        try:
            decoded = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
        return decoded if isinstance(decoded, dict) else raw
    return raw


def take_task(messages: Sequence[Any]) -> tuple[str, list[Any]]:
    """The first user message's text, and the messages without it."""
    for index, msg in enumerate(messages):
        if isinstance(msg, dict) and msg.get("role") == "user":
            return text_of(msg.get("content")), [*messages[:index], *messages[index + 1 :]]
    return "", list(messages)


def match_status(
    text: str | None, table: Sequence[tuple[str, Status]], default: Status = Status.UNKNOWN
) -> Outcome:
    """The first status whose key occurs in `text` (case-insensitive), with the source's
    words as the reason."""
    if not text:
        return Outcome(status=default)
    lowered = text.lower()
    for key, status in table:
        if key in lowered:
            return Outcome(status=status, reason=text)
    return Outcome(status=default, reason=text)


def stable_id(trace: Trace) -> str:
    """A content hash: re-importing the same trajectory yields the same trace_id, which
    the hub treats as an idempotency key."""
    body = orjson.dumps(
        trace.model_dump(mode="json", exclude={"trace_id"}), option=orjson.OPT_SORT_KEYS
    )
    return f"{trace.source_format}-{hashlib.sha256(body).hexdigest()[:32]}"


# -- OpenAI-style chat -------------------------------------------------------------


def chat_steps(
    messages: Iterable[Any],
    *,
    tool_error: Callable[[str], str | None],
    thought_tools: frozenset[str] = frozenset(),
) -> Iterator[Step]:
    """Steps from OpenAI chat messages: `tool_calls` or legacy `function_call`, results
    as `tool` or `function` messages. Calls to a tool in `thought_tools` (tau-bench's
    `think`) are thoughts, and their empty results are dropped."""
    ids = CallIds()
    thought_ids: set[str] = set()
    for msg in messages:
        role = msg.get("role")
        text = text_of(msg.get("content"))
        if role in ("tool", "function"):
            call_id = msg.get("tool_call_id") or ids.last
            if call_id in thought_ids:
                thought_ids.discard(call_id)  # sources reuse ids: drop only this answer
                continue
            yield observation(text, call_id=call_id, error=tool_error(text))
            continue
        calls = msg.get("tool_calls") or (
            [msg["function_call"]] if msg.get("function_call") else []
        )
        if role != "assistant" or not calls:
            yield message(str(role or "user"), text)
            continue
        if text.strip():
            # Text said alongside a call is the agent's reasoning for it.
            yield thought(text)
        for call in calls:
            function = call.get("function", call)
            name = function.get("name")
            arguments = parse_arguments(function.get("arguments"))
            call_id = call.get("id") or ids.new()
            if name in thought_tools:
                thought_ids.add(call_id)
                said = arguments.get("thought") if isinstance(arguments, dict) else arguments
                yield thought(str(said or ""))
            else:
                thought_ids.discard(call_id)
                yield action(name, arguments, call_id)


# -- ReAct text (Thought / Action / Observation) -------------------------------------

_REACT_ACTION = re.compile(r"^\s*(\w+)\[(.*)\]\s*$", re.DOTALL)


def react_steps(
    blocks: Iterable[tuple[str, str]],
    *,
    tool_error: Callable[[str], str | None],
    is_verdict: Callable[[str], bool],
) -> tuple[list[Step], str | None]:
    """Steps from ReAct blocks `(kind, text)`, kind in Thought|Action|Observation.

    `Tool[arg]` becomes an action with `{"input": arg}`, `Finish[answer]` the final
    answer; an action that does not parse keeps its text with no tool, so
    `empty_action` sees it. An observation for which `is_verdict` holds is the
    environment's judgement, not a tool result: it is returned, not stepped.
    """
    steps: list[Step] = []
    verdict: str | None = None
    ids = CallIds()
    for kind, text in blocks:
        text = text.strip()
        if kind == "Thought":
            steps.append(thought(text))
        elif kind == "Action":
            parsed = _REACT_ACTION.match(text)
            if parsed is None:
                steps.append(action(None, text, ids.new()))
            elif parsed.group(1).lower() == "finish":
                steps.append(final(parsed.group(2)))
            else:
                steps.append(action(parsed.group(1), {"input": parsed.group(2)}, ids.new()))
        elif is_verdict(text):
            verdict = text
        else:
            steps.append(observation(text, call_id=ids.last, error=tool_error(text)))
    return steps, verdict
