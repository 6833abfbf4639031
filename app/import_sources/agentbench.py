"""AgentBench task-server output: `{index, error, info, output: {index, status,
result, history}, time}`, `history` being `{role: user|agent, content}` turns.

The first user turn is the task (tool spec and question). Agent turns are actions
written as text: `GET url`, `POST url` followed by a JSON body, or `FINISH([...])`,
the final answer; any other agent text is a message (AgentBench ends such a run as
`agent invalid action`). The user turn after an action is its observation;
MedAgentBench's `Invalid POST request` and `Error in sending the GET request: ...`
are tool errors.

Status from `output.status`: `completed` is `unknown`, because correctness is scored
separately (overall.json) and is not in the file; `agent invalid action` and
`agent validation failed` are `failure`; `task limit reached` and
`agent context limit` are limits: `timeout`; `task error` is `error`. A record with
a top-level `error` and no final status (`running`) is `error`.

A record whose history is null (a run that failed before anything was recorded, as in
error.jsonl) has no trajectory: it is reported as unreadable, with its error, rather
than stored as an empty trace that could only ever be rejected.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from app.domain import Outcome, Status, Step, Trace
from app.import_sources._common import (
    CallIds,
    Unusable,
    action,
    final,
    match_status,
    message,
    observation,
    parse_arguments,
    take_task,
    text_of,
)

NAME = "agentbench"

_FINISH = re.compile(r"^\s*FINISH\((.*)\)\s*$", re.DOTALL)
_REQUEST = re.compile(r"^\s*(GET|POST)\s+(\S+)[ \t]*(?:\n(.*))?$", re.DOTALL)
_TOOL_ERROR = re.compile(r"^(?:Invalid (?:GET|POST) request|Error in sending the)")
_STATUS = (
    ("completed", Status.UNKNOWN),
    ("agent invalid action", Status.FAILURE),
    ("agent validation failed", Status.FAILURE),
    ("task limit reached", Status.TIMEOUT),
    ("agent context limit", Status.TIMEOUT),
    ("task error", Status.ERROR),
)


def looks_like(obj: Any) -> bool:
    output = obj.get("output") if isinstance(obj, dict) else None
    return isinstance(output, dict) and "status" in output and "history" in output


def parse(obj: dict[str, Any]) -> Iterator[Trace]:
    output = obj["output"]
    status, error = output.get("status"), obj.get("error")
    if output.get("history") is None:
        raise Unusable(
            f"AgentBench record {obj.get('index')} has no history (status {status!r}, "
            f"error {error!r}: {obj.get('info')!r}): the run failed before a trajectory "
            "was recorded"
        )
    task, turns = take_task(output["history"])
    yield Trace(
        task=task,
        steps=list(_steps(turns)),
        outcome=_outcome(status, error),
        metadata={
            "index": obj.get("index"),
            "status": status,
            "result": output.get("result"),
            "error": error,
            "time": (obj.get("time") or {}).get("str"),
        },
        source_format=NAME,
    )


def _outcome(status: str | None, error: Any) -> Outcome:
    outcome = match_status(status, _STATUS)
    if error and outcome.status is Status.UNKNOWN and status != "completed":
        return Outcome(status=Status.ERROR, reason=str(error))
    return outcome


def _steps(turns: list[dict[str, Any]]) -> Iterator[Step]:
    ids = CallIds()
    pending = False  # whether the next user turn answers an action
    for turn in turns:
        text = text_of(turn.get("content"))
        if turn.get("role") != "agent":
            if pending:
                error = text if _TOOL_ERROR.match(text) else None
                yield observation(text, call_id=ids.last, error=error)
            else:
                yield message("user", text)
            pending = False
            continue
        request, finish = _REQUEST.match(text), _FINISH.match(text)
        pending = request is not None
        if request is not None:
            method, url, body = request.groups()
            arguments: dict[str, Any] = {"url": url}
            if body and body.strip():
                arguments["payload"] = parse_arguments(body.strip())
            yield action(method, arguments, ids.new())
        elif finish is not None:
            yield final(finish.group(1))
        else:
            yield message("assistant", text)
