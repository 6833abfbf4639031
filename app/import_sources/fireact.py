"""FireAct fine-tuning data: `{"messages": [...]}` with user and assistant turns only,
in ReAct text form. The first user message is the question; the assistant writes
`Thought: ...` and `Action: tool[arg]` (`finish[answer]` to answer); the user replies
`Observation: ...` with the tool output.

The environment's last observation, `Episode finished, reward = True|False`, is the
environment's reward (True 1.0, False 0.0); a reward is not a status, so the status is
unknown. The source marks no tool errors.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from app.domain import Agent, Outcome, Trace
from app.import_sources._common import react_steps, take_task, text_of

NAME = "fireact"

_BLOCK = re.compile(r"^(Thought|Action|Observation):[ \t]*", re.MULTILINE)
_REWARD = re.compile(r"^Episode finished, reward = (\w+)")


def looks_like(obj: Any) -> bool:
    messages = obj.get("messages") if isinstance(obj, dict) else None
    if not isinstance(messages, list) or not messages:
        return False
    said = [text_of(m.get("content")) for m in messages if isinstance(m, dict)]
    return any(_BLOCK.match(text) for text in said[1:]) and all(
        isinstance(m, dict) and m.get("role") in ("user", "assistant") for m in messages
    )


def parse(obj: dict[str, Any]) -> Iterator[Trace]:
    task, messages = take_task(obj["messages"])
    blocks = [block for m in messages for block in _blocks(m)]
    steps, verdict = react_steps(
        blocks, tool_error=lambda _text: None, is_verdict=lambda text: bool(_REWARD.match(text))
    )
    yield Trace(
        task=task,
        agent=Agent(name="FireAct ReAct"),
        steps=steps,
        outcome=verdict_outcome(verdict),
        source_format=NAME,
    )


def _blocks(msg: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """`Thought: a\\nAction: b` -> (Thought, a), (Action, b). Unmarked text is what the
    role usually says: a user's is an observation, an assistant's a thought."""
    text = text_of(msg.get("content"))
    marks = list(_BLOCK.finditer(text))
    if not marks:
        yield ("Observation" if msg.get("role") == "user" else "Thought"), text
    for mark, after in zip(marks, [*marks[1:], None], strict=True):
        yield mark.group(1), text[mark.end() : after.start() if after else len(text)]


def verdict_outcome(verdict: str | None) -> Outcome:
    """The outcome the environment's closing line says (also read by `atropos rescore`
    from traces imported before the hub kept environment rewards)."""
    found = _REWARD.match(verdict or "")
    if found is None:
        return Outcome()
    word = found.group(1)
    if word in ("True", "False"):
        return Outcome(reward=1.0 if word == "True" else 0.0, reason=verdict)
    try:
        return Outcome(reward=float(word), reason=verdict)
    except ValueError:  # neither a boolean nor a number: keep the words, claim nothing
        return Outcome(reason=verdict)
