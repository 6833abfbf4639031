"""OpenHands runs: evaluation output lines `{instance_id, instruction, history, error,
metrics, test_result, ...}`, bare event lists (runtime trajectories), and the older
resolver output `{issue, history, success, result_explanation, ...}`.

An event is an action (`action`: run, read, edit, think, message, finish, ...) or an
observation (`observation`: run, read, edit, error, ...) that names its action in
`cause`. Resolver events are the same, flattened (no `args`, no ids).

Tool errors are what OpenHands itself marks as errors: an `error` observation, and
the file editors' failures (`ERROR: ...`, `[Your proposed edit has introduced new
syntax error(s)...`). A `run` observation's non-zero exit code is kept
in `exit_code` and is not an error by itself (a failing test run is a normal step).
Bookkeeping events (recall, agent state changes, null observations) are not steps.

Status: a run whose `error` says it reached its maximum iteration (or budget) is a
`timeout`; any other `error` is `error`; the resolver's `success` is success or
failure; otherwise `unknown`, since evaluation output has no resolved flag.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from app.domain import Agent, Outcome, Status, Step, Trace
from app.import_sources._common import (
    CallIds,
    action,
    final,
    match_status,
    message,
    observation,
    parse_arguments,
    thought,
)

NAME = "openhands"

_SKIPPED = frozenset({"recall", "change_agent_state", "agent_state_changed", "null", "think"})
# Runtime settings stored beside the model's arguments; not what the agent asked for.
_RUNTIME_KEYS = frozenset(
    {
        "action", "thought", "is_input", "blocking", "is_static", "cwd", "hidden",
        "impl_source", "translated_ipython_code", "keep_prompt", "is_confirmed",
        "action_risk", "confirmation_state", "security_risk", "kernel_init_code",
        "images_urls", "image_urls", "wait_for_response",
    }
)  # fmt: skip
# How OpenHands' editors report a failed call: the oh_aci editor's `ERROR:` and the
# older agentskills editor's rejected edit. Only for editor/IPython results: a shell
# command may print anything.
_EDITOR_ERROR = re.compile(r"^(?:ERROR:|\[Your proposed edit has introduced new syntax error)")
_EDITOR_RESULTS = frozenset({"edit", "read", "run_ipython"})
_ERROR_STATUS = (
    ("maximum iteration", Status.TIMEOUT),
    ("maximum budget", Status.TIMEOUT),
)


def looks_like(obj: Any) -> bool:
    events = obj.get("history") if isinstance(obj, dict) else obj
    if not isinstance(events, list) or not events or not isinstance(events[0], dict):
        return False
    if isinstance(obj, list):
        # A bare event list: only the event stream has `source` on each event.
        return all(isinstance(e, dict) and "source" in e for e in events)
    return "action" in events[0] or "observation" in events[0]


def parse(obj: list[Any] | dict[str, Any]) -> Iterator[Trace]:
    run = obj if isinstance(obj, dict) else {}
    task = str(run.get("instruction") or "")
    steps: list[Step] = []
    events = run.get("history") if isinstance(obj, dict) else obj
    for step in _steps(events or []):
        if step.role == "user" and (not task or step.content == task):
            task = task or step.content or ""  # the opening request is the task
            continue
        steps.append(step)
    metrics = run.get("metrics") or {}
    yield Trace(
        task=task,
        agent=Agent(
            name=(run.get("metadata") or {}).get("agent_class") or "OpenHands",
            model=((run.get("metadata") or {}).get("llm_config") or {}).get("model"),
        ),
        steps=steps,
        outcome=_outcome(run),
        metadata={
            key: value
            for key, value in {
                "instance_id": run.get("instance_id"),
                "error": run.get("error"),
                "cost": metrics.get("accumulated_cost") if isinstance(metrics, dict) else None,
                "git_patch": run.get("git_patch")
                or (run.get("test_result") or {}).get("git_patch"),
                "result_explanation": run.get("result_explanation"),
            }.items()
            if value is not None
        },
        source_format=NAME,
    )


def _outcome(run: dict[str, Any]) -> Outcome:
    if run.get("error"):
        return match_status(str(run["error"]), _ERROR_STATUS, default=Status.ERROR)
    if isinstance(run.get("success"), bool):
        status = Status.SUCCESS if run["success"] else Status.FAILURE
        return Outcome(status=status, reason=run.get("result_explanation"))
    return Outcome(status=Status.UNKNOWN)


def _steps(events: list[dict[str, Any]]) -> Iterator[Step]:
    ids = CallIds("event")
    by_event: dict[Any, str] = {}  # event id -> call id, to pair `cause` with its action
    for event in events:
        if "action" in event:
            yield from _action(event, ids, by_event)
        elif "observation" in event and event["observation"] not in _SKIPPED:
            yield _observation(event, ids, by_event)


def _action(event: dict[str, Any], ids: CallIds, by_event: dict[Any, str]) -> Iterator[Step]:
    kind = event["action"]
    args = event.get("args", event)  # resolver events are flat
    said = str(args.get("thought") or "")
    if kind in _SKIPPED - {"think"}:
        return
    if kind == "think":
        yield thought(said)
    elif kind == "system":
        yield message("system", str(args.get("content") or event.get("message") or ""))
    elif kind == "message":
        # Resolver events have no `source`; their only message is the user's request.
        role = "user" if event.get("source", "user") == "user" else "assistant"
        yield message(role, str(args.get("content") or event.get("message") or ""))
    elif kind == "finish":
        yield final(str(args.get("final_thought") or event.get("message") or said))
    else:
        if said:
            yield thought(said)
        meta = event.get("tool_call_metadata") or {}
        call_id = meta.get("tool_call_id") or ids.new()
        ids.last = call_id
        if "id" in event:
            by_event[event["id"]] = call_id
        yield action(meta.get("function_name") or kind, _arguments(args, meta), call_id)


def _arguments(args: dict[str, Any], meta: dict[str, Any]) -> Any:
    """The arguments the model wrote, from the raw completion when it is recorded."""
    for choice in (meta.get("model_response") or {}).get("choices") or []:
        for call in (choice.get("message") or {}).get("tool_calls") or []:
            if call.get("id") == meta.get("tool_call_id"):
                return parse_arguments((call.get("function") or {}).get("arguments"))
    return {key: value for key, value in args.items() if key not in _RUNTIME_KEYS}


def _observation(event: dict[str, Any], ids: CallIds, by_event: dict[Any, str]) -> Step:
    kind = event["observation"]
    content = str(event.get("content") or "")
    meta = (event.get("extras") or {}).get("metadata") or {}
    exit_code = event.get("exit_code", meta.get("exit_code"))
    is_error = kind == "error" or (kind in _EDITOR_RESULTS and bool(_EDITOR_ERROR.match(content)))
    call_id = _answered_call(event, ids, by_event)
    return observation(
        content,
        call_id=call_id,
        error=content if is_error else None,
        exit_code=exit_code if isinstance(exit_code, int) else None,
    )


def _answered_call(event: dict[str, Any], ids: CallIds, by_event: dict[Any, str]) -> str | None:
    if "cause" in event:
        return by_event.get(event["cause"])
    meta = event.get("tool_call_metadata") or {}
    if meta.get("tool_call_id"):
        return str(meta["tool_call_id"])
    # Resolver events have no ids: a result follows its action. An event-stream
    # observation without a cause (a rejected tool call) answers no action.
    return ids.last if "id" not in event else None
