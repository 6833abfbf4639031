"""Atropos `ScoredDataGroup` lines: `{tokens, masks, scores, messages, parsed_actions,
seed, ...}`, one GRPO group of rollouts. One trace per rollout: `messages[i]` with
`scores[i]`.

Roles are system, environment (or user/tool) and agent (or assistant). Agent turns
are Hermes-style: `<think>...</think>` then `<tool_call>{"name", "arguments"}</tool_call>`;
the system prompt declares the tools in `<tools>[...]</tools>`. An environment turn
after a call is its observation.

There is no success flag, only a float score: the environment's reward. A reward is
not a status, so the status is `unknown` whatever the score. The parsed action is in
metadata. An agent turn with neither text nor a call
(a truncated `<think>`) is kept as an empty assistant message, so `empty_action`
can see it. Token ids and masks are not kept: the messages carry the trajectory.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from app.domain import Outcome, Step, Trace
from app.formats._common import tag_blocks
from app.import_sources._common import (
    CallIds,
    Unusable,
    action,
    env_reward,
    message,
    observation,
    parse_arguments,
    text_of,
    thought,
)

NAME = "atropos_group"

_AGENT = frozenset({"agent", "assistant", "gpt"})


def looks_like(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("scores"), list) and "tokens" in obj


def parse(obj: dict[str, Any]) -> Iterator[Trace]:
    rollouts = obj.get("messages")
    if not rollouts:
        raise Unusable("the group has no messages; its token ids cannot be read as text")
    scores = obj["scores"]
    parsed_actions = obj.get("parsed_actions") or [None] * len(rollouts)
    for index, (chat, score) in enumerate(zip(rollouts, scores, strict=True)):
        yield _rollout(chat, score, parsed_actions[index], obj, index)


def _rollout(
    chat: list[dict[str, Any]], score: float, parsed: Any, group: dict[str, Any], index: int
) -> Trace:
    system = next((text_of(m.get("content")) for m in chat if m.get("role") == "system"), "")
    task, steps = "", list[Step]()
    ids = CallIds()
    answered = True  # whether the last call already has its observation
    for msg in chat:
        role, text = msg.get("role"), text_of(msg.get("content"))
        if role == "system":
            steps.append(message("system", text))
        elif role in _AGENT:
            steps.extend(_agent_turn(text, ids))
            answered = not steps[-1].call_id
        elif not task:
            task = text  # the environment's first state is the task
        elif not answered:
            steps.append(observation(text, call_id=ids.last))
            answered = True
        else:
            steps.append(message("user", text))
    return Trace(
        task=task,
        tools=_declared_tools(system),
        steps=steps,
        outcome=Outcome(reward=env_reward(score)),
        metadata={
            "rollout": index,
            "group_size": len(group["scores"]),
            "parsed_action": parsed,
            "seed": group.get("seed"),
        },
        source_format=NAME,
    )


def _agent_turn(text: str, ids: CallIds) -> list[Step]:
    thoughts, unthought = tag_blocks(text, "<think>", "</think>", open_to_end=True)
    steps = [thought(t.strip()) for t in thoughts if t.strip()]
    said = tag_blocks(unthought, "<tool_call>", "</tool_call>", open_to_end=True)[1].strip()
    if said:
        steps.append(message("assistant", said))
    for raw in tag_blocks(text, "<tool_call>", "</tool_call>", open_to_end=True)[0]:
        call = parse_arguments(raw.strip())
        if isinstance(call, dict):
            steps.append(action(call.get("name"), call.get("arguments"), ids.new()))
        else:
            steps.append(action(None, raw.strip(), ids.new()))  # a call that is not JSON
    return steps or [message("assistant", "")]


def _declared_tools(system: str) -> list[str] | None:
    found = tag_blocks(system, "<tools>", "</tools>")[0]
    if not found:
        return None
    try:
        tools = orjson.loads(found[0])
    except orjson.JSONDecodeError:
        return None
    names = [(t.get("function") or t).get("name") for t in tools if isinstance(t, dict)]
    return [n for n in names if n] or None
