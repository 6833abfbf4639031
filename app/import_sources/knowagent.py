"""KnowAgent ALFWorld trajectories: `{name, result, traj}`, `traj` being one text.

The text opens with the environment's description and the task, then lines
`> Think: ...` (thought), `> ActionPath: ...` (the agent's plan state, kept as an
assistant message) and `> <command>` (an action), each action followed by the
environment's reply. ALFWorld answers an invalid or ineffective action with
`Nothing happens.`, its only error signal, so that reply is a tool error.

Success is `result`, which is mixed-typed (true, false, 0): truthy is success.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from app.domain import Agent, Outcome, Status, Step, Trace
from app.import_sources._common import CallIds, command_action, message, observation, thought

NAME = "knowagent"

_PROMPT = "> "
_INVALID = "Nothing happens."


def looks_like(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("traj"), str) and "result" in obj


def parse(obj: dict[str, Any]) -> Iterator[Trace]:
    lines = obj["traj"].split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith(_PROMPT)), len(lines))
    result = obj.get("result")
    yield Trace(
        task="\n".join(lines[:start]).strip(),
        agent=Agent(name="KnowAgent"),
        steps=list(_steps(lines[start:])),
        outcome=Outcome(
            status=Status.SUCCESS if result else Status.FAILURE, reason=f"result: {result!r}"
        ),
        metadata={"name": obj.get("name"), "result": result},
        source_format=NAME,
    )


def _steps(lines: list[str]) -> Iterator[Step]:
    ids = CallIds()
    reply: list[str] = []
    for line in lines:
        if not line.startswith(_PROMPT):
            reply.append(line)
            continue
        yield from _reply(reply, ids)
        reply = []
        said = line[len(_PROMPT) :]
        if said.startswith("Think:"):
            yield thought(said.removeprefix("Think:").strip())
        elif said.startswith("ActionPath:"):
            yield message("assistant", said)
        else:
            ids.new()
            yield command_action(said, ids.last)
    yield from _reply(reply, ids)


def _reply(lines: list[str], ids: CallIds) -> Iterator[Step]:
    text = "\n".join(lines).strip()
    if text:
        yield observation(text, call_id=ids.last, error=text if text == _INVALID else None)
