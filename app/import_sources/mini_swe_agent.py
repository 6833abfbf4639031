"""mini-swe-agent trajectories: a bare list of chat messages (old format) or
`{info: {exit_status, submission, model_stats}, messages}` (newer).

The assistant writes its reasoning, then one fenced bash block (the action). The
next user message is `<returncode>N</returncode><output>...</output>`; SOURCES.md
names a non-zero returncode a tool error for this source, so it is one here, and the
code is kept in `exit_code` too. The command `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`
submits: the message after it is the submission (the diff), the command's output.

Status: `Submitted` (or the submit command, in the old format) is `unknown` for the
same reason as SWE-agent's `submitted`: no resolved label in the file.
`LimitsExceeded` and `TimeExceeded` are `timeout`; a format error is `failure`; any
other exit status (an exception name) is `error`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from app.domain import Agent, Outcome, Status, Step, Trace
from app.import_sources._common import (
    CallIds,
    command_action,
    match_status,
    message,
    observation,
    take_task,
    text_of,
    thought,
)

NAME = "mini_swe_agent"

_SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
_BLOCK = re.compile(r"```(?:mswea_bash_command|bash)[ \t]*\n(.*?)\n?```", re.DOTALL)
_RESULT = re.compile(r"^\s*<returncode>(-?\d+)</returncode>\s*(.*)$", re.DOTALL)
_OUTPUT = re.compile(r"^<output>\n?(.*?)\n?</output>\s*$", re.DOTALL)
_STATUS = (
    ("submitted", Status.UNKNOWN),
    ("limitsexceeded", Status.TIMEOUT),
    ("timeexceeded", Status.TIMEOUT),
    ("format", Status.FAILURE),
)


def looks_like(obj: Any) -> bool:
    if isinstance(obj, dict) and isinstance(obj.get("info"), dict):
        obj = obj.get("messages")
    if not isinstance(obj, list) or not all(isinstance(m, dict) and "role" in m for m in obj):
        return False
    return any(
        _SUBMIT in text_of(m.get("content")) or _RESULT.match(text_of(m.get("content")))
        for m in obj
    )


def parse(obj: list[Any] | dict[str, Any]) -> Iterator[Trace]:
    info = (obj.get("info") or {}) if isinstance(obj, dict) else {}
    messages = obj["messages"] if isinstance(obj, dict) else obj
    task, rest = take_task(messages)
    steps = list(_steps(rest))
    stats = info.get("model_stats") or {}
    yield Trace(
        task=task,
        agent=Agent(name="mini-swe-agent"),
        steps=steps,
        outcome=_outcome(info.get("exit_status"), submitted=any(_submits(s) for s in steps)),
        metadata={
            "exit_status": info.get("exit_status"),
            "submission": info.get("submission"),
            "cost": stats.get("instance_cost"),
            "api_calls": stats.get("api_calls"),
        },
        source_format=NAME,
    )


def _outcome(exit_status: str | None, *, submitted: bool) -> Outcome:
    if exit_status:
        return match_status(exit_status, _STATUS, default=Status.ERROR)
    if submitted:
        return Outcome(status=Status.UNKNOWN, reason=f"submitted ({_SUBMIT})")
    return Outcome(status=Status.UNKNOWN)


def _submits(step: Step) -> bool:
    return isinstance(step.arguments, dict) and _SUBMIT in str(step.arguments.get("command"))


def _steps(messages: list[dict[str, Any]]) -> Iterator[Step]:
    ids = CallIds()
    pending: Step | None = None  # the action whose result the next user message is
    for msg in messages:
        role, text = msg.get("role"), text_of(msg.get("content"))
        if role == "assistant":
            block = _BLOCK.search(text)
            if block is None:
                pending = None
                yield message("assistant", text)
                continue
            if text[: block.start()].strip():
                yield thought(text[: block.start()].strip())
            pending = command_action(block.group(1), ids.new(), tool="bash")
            yield pending
        elif role == "user" and pending is not None:
            yield _result(text, pending)
            pending = None
        else:
            yield message(str(role), text)


def _result(text: str, call: Step) -> Step:
    result = _RESULT.match(text)
    if result is None:
        # The submission: printed by the submit command, without the usual wrapper.
        return observation(text, call_id=call.call_id)
    code, output = int(result.group(1)), result.group(2)
    wrapped = _OUTPUT.match(output)
    if wrapped is not None:
        output = wrapped.group(1)
    error = (output or f"returncode {code}") if code != 0 else None
    return observation(output, call_id=call.call_id, error=error, exit_code=code)
