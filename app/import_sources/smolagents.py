"""smolagents benchmark output: `{model_id, agent_action_type, question, answer,
true_answer, source, intermediate_steps, ...}`, `intermediate_steps` being the
agent's memory as chat messages (system, user, assistant, tool-call, tool-response).

The assistant text is the thought (for the CodeAgent, with its code); a `tool-call`
message is the action (`Calling tools:` followed by a Python literal); a
`tool-response` is the observation, and one starting with `Error:` is a tool or code
error. `Reached max steps.` is not a tool result but the step limit: `timeout`.

Otherwise success is judged as the upstream benchmark does, since the file has no
flag: `answer` against `true_answer` by GAIA's quasi-exact match (numbers compared
as numbers, lists element by element, strings without case, spaces and punctuation).
"""

from __future__ import annotations

import ast
import re
import string
from collections.abc import Iterator
from typing import Any

from app.domain import Agent, Outcome, Status, Step, Trace
from app.formats._common import tag_blocks
from app.import_sources._common import (
    CallIds,
    action,
    final,
    message,
    observation,
    parse_arguments,
    text_of,
    thought,
)

NAME = "smolagents"

_MAX_STEPS = "Reached max steps."
_CALLS = re.compile(r"^\s*Calling tools:\s*(\[.*\])\s*$", re.DOTALL)
# The ToolCallingAgent's assistant text only restates the call that follows.
_CALL_ECHO = re.compile(r"^Tool call [^:]*: calling '")
_TOOL_LIST = "You only have access to these tools:\n"
_TOOL_NAME = re.compile(r"^- (\w+):", re.MULTILINE)
_NO_PUNCTUATION = str.maketrans("", "", string.punctuation + string.whitespace)


def looks_like(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("intermediate_steps"), list)


def parse(obj: dict[str, Any]) -> Iterator[Trace]:
    memory = obj["intermediate_steps"]
    steps = list(_steps(memory))
    answer = obj.get("answer")
    if answer is not None:
        steps.append(final(str(answer)))
    limited = any(_MAX_STEPS in text_of(m.get("content")) for m in memory if _is_response(m))
    kind = obj.get("agent_action_type")
    truth = obj.get("true_answer")
    correct = None if answer is None or truth is None else _quasi_exact(str(answer), str(truth))
    yield Trace(
        task=str(obj.get("question") or ""),
        agent=Agent(
            name="smolagents CodeAgent" if kind == "code" else "smolagents ToolCallingAgent",
            model=obj.get("model_id"),
        ),
        env=obj.get("source"),
        tools=_declared_tools(memory) if kind != "code" else None,
        steps=steps,
        outcome=_outcome(limited, correct),
        metadata={
            "true_answer": truth,
            "correct": correct,
            "agent_action_type": kind,
            "token_counts": obj.get("token_counts"),
            "start_time": obj.get("start_time"),
            "end_time": obj.get("end_time"),
        },
        source_format=NAME,
    )


def _outcome(limited: bool, correct: bool | None) -> Outcome:
    if limited:
        # The answer written after the limit is unsupported, whatever it says.
        return Outcome(status=Status.TIMEOUT, reason=_MAX_STEPS)
    if correct is None:
        return Outcome(status=Status.UNKNOWN)
    if correct:
        return Outcome(status=Status.SUCCESS, reason="answer matches true_answer")
    return Outcome(status=Status.FAILURE, reason="answer does not match true_answer")


def _is_response(msg: dict[str, Any]) -> bool:
    return msg.get("role") == "tool-response"


def _steps(memory: list[dict[str, Any]]) -> Iterator[Step]:
    ids = CallIds()
    task_seen = False
    pending: str | None = None  # the call the next tool-response answers
    for msg in memory:
        role, text = msg.get("role"), text_of(msg.get("content"))
        if role == "user" and not task_seen:
            task_seen = True  # "New task: ..." is the question, kept as the task
        elif role == "assistant":
            if not _CALL_ECHO.match(text):
                yield thought(text)
        elif role == "tool-call":
            for name, arguments, call_id in _calls(msg, text):
                pending = call_id or ids.new()
                yield action(name, arguments, pending)
        elif _is_response(msg) and _MAX_STEPS in text:
            yield message("user", text)
        elif _is_response(msg):
            # A response with no call before it is the parser rejecting the model's
            # output (no code block): still an error, but of no call.
            error = text if text.startswith("Error:") else None
            yield observation(text, call_id=pending, error=error)
            pending = None
        else:
            yield message(str(role), text)


def _calls(msg: dict[str, Any], text: str) -> Iterator[tuple[str | None, Any, str | None]]:
    calls = msg.get("tool_calls")
    if not calls:
        found = _CALLS.match(text)
        # The memory stores the calls as a Python repr, not JSON; literal_eval reads
        # it without executing anything.
        calls = ast.literal_eval(found.group(1)) if found else []
    for call in calls:
        function = call.get("function") or {}
        name, arguments = function.get("name"), parse_arguments(function.get("arguments"))
        if name == "python_interpreter" and isinstance(arguments, str):
            arguments = {"code": arguments}  # the CodeAgent's code is the tool's input
        yield name, arguments, call.get("id")


def _declared_tools(memory: list[dict[str, Any]]) -> list[str] | None:
    system = next((m for m in memory if m.get("role") == "system"), None)
    found = tag_blocks(text_of(system.get("content")), _TOOL_LIST, "\n\n")[0] if system else []
    return (_TOOL_NAME.findall(found[0]) or None) if found else None


def _quasi_exact(answer: str, truth: str) -> bool:
    if _number(truth) is not None:
        return _number(answer) == _number(truth)
    if any(sep in truth for sep in ",;"):
        got, want = re.split(r"[,;]", answer), re.split(r"[,;]", truth)
        return len(got) == len(want) and all(map(_quasi_exact, got, want))
    return answer.translate(_NO_PUNCTUATION).lower() == truth.translate(_NO_PUNCTUATION).lower()


def _number(text: str) -> float | None:
    try:
        return float(text.replace("$", "").replace("%", "").replace(",", "").strip())
    except ValueError:
        return None
