"""SWE-agent `.traj` files: `{environment, trajectory, history, info, replay_config?}`.

Steps come from `trajectory[]` (thought, action, observation). When the run used
function calling, the matching assistant message in `history` gives the real tool
name, arguments and call id; otherwise the action is a text command. `history`
messages marked `is_demo` are an in-context demonstration and are ignored.

Status from `info.exit_status`: `submitted` is `unknown`, because a submitted patch
is only the agent's claim; whether it resolves the issue is decided by a separate
evaluation that is not in the file (rewarding every submission as a success would
teach "submit anything"). `exit_cost` and `exit_context` (also as
`submitted (exit_cost)`, an auto-submission at the limit) are budget or context
limits: `timeout`. `exit_error` is an environment error: `error`. Other `exit_*`
(`exit_format`, `exit_forfeit`, `early_exit`) are the agent failing: `failure`.

Tool errors have no flag in this format; only two observation texts are
unambiguous tool-level errors: `bash: ...: command not found` and the editor's
`Your proposed edit has introduced new syntax error(s)`. Tracebacks are not (a
reproduction script is expected to fail).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from app.domain import Agent, Status, Step, Trace
from app.import_sources._common import (
    action,
    command_action,
    match_status,
    message,
    observation,
    parse_arguments,
    text_of,
    thought,
)

NAME = "swe_agent"

_TOOL_ERROR = re.compile(
    r"^(?:bash: .*command not found|Your proposed edit has introduced new syntax error)",
    re.MULTILINE,
)
_STATUS = (
    ("exit_cost", Status.TIMEOUT),
    ("exit_context", Status.TIMEOUT),
    ("exit_error", Status.ERROR),
    ("submitted", Status.UNKNOWN),
    ("exit", Status.FAILURE),
)


def looks_like(obj: Any) -> bool:
    return (
        isinstance(obj, dict)
        and isinstance(obj.get("trajectory"), list)
        and isinstance(obj.get("info"), dict)
    )


def parse(obj: dict[str, Any]) -> Iterator[Trace]:
    history = [m for m in obj.get("history") or [] if not m.get("is_demo")]
    info = obj["info"]
    stats = info.get("model_stats") or {}
    yield Trace(
        task=next((text_of(m.get("content")) for m in history if m.get("role") == "user"), ""),
        agent=Agent(name="SWE-agent"),
        env=obj.get("environment") if isinstance(obj.get("environment"), str) else None,
        steps=list(_steps(obj["trajectory"], history)),
        outcome=match_status(info.get("exit_status"), _STATUS),
        metadata={
            "exit_status": info.get("exit_status"),
            "submission": info.get("submission"),
            "cost": stats.get("instance_cost"),
            "api_calls": stats.get("api_calls"),
        },
        source_format=NAME,
    )


def _steps(trajectory: list[dict[str, Any]], history: list[dict[str, Any]]) -> Iterator[Step]:
    system = next((m for m in history if m.get("role") == "system"), None)
    if system is not None:
        yield message("system", text_of(system.get("content")))
    assistant = [m for m in history if m.get("role") == "assistant"]
    for index, entry in enumerate(trajectory):
        if entry.get("thought"):
            yield thought(entry["thought"])
        call = _function_call(entry, assistant[index] if index < len(assistant) else None)
        if call is None:
            call = command_action(entry.get("action") or "", f"step_{index + 1}")
        yield call
        result = text_of(entry.get("observation"))
        error = result if _TOOL_ERROR.search(result) else None
        yield observation(result, call_id=call.call_id, error=error)


def _function_call(entry: dict[str, Any], msg: dict[str, Any] | None) -> Step | None:
    """The tool call behind a trajectory step, when the run used function calling and
    the history message at the same position is that step."""
    if not msg or not msg.get("tool_calls"):
        return None
    if (msg.get("action") or "").strip() != (entry.get("action") or "").strip():
        return None
    call = msg["tool_calls"][0]
    function = call.get("function") or {}
    return action(function.get("name"), parse_arguments(function.get("arguments")), call.get("id"))
