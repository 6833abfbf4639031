"""tau-bench historical trajectories: `{task_id, trial, reward, info, traj}` records,
`traj` being OpenAI chat messages with `tool_calls`.

`reward` is the environment's reward (tau-bench's pass^k counts 1.0 as solved); it is
not a status, so the status is unknown. A tool result starting with `Error:` is a tool
error; calls to the `think` tool are the agent's thoughts. The records do not say
the domain or the model: the file's name does (`gpt-4o-airline.json`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from app.domain import Outcome, Trace
from app.import_sources._common import chat_steps, env_reward, take_task

NAME = "tau_bench"

_THOUGHT_TOOLS = frozenset({"think"})
# tau-bench's domains; its historical trajectories are named `<model>-<domain>.json`.
_DOMAINS = ("airline", "retail", "telecom")


def looks_like(obj: Any) -> bool:
    return isinstance(obj, dict) and {"traj", "reward", "task_id"} <= obj.keys()


def parse(obj: dict[str, Any]) -> Iterator[Trace]:
    task, messages = take_task(obj["traj"])
    info = obj.get("info") or {}
    yield Trace(
        task=task,
        steps=list(chat_steps(messages, tool_error=_tool_error, thought_tools=_THOUGHT_TOOLS)),
        outcome=Outcome(reward=env_reward(obj.get("reward"))),
        metadata={
            "task_id": obj.get("task_id"),
            "trial": obj.get("trial"),
            # Who ended the conversation: the user (###STOP###) or a tool such as
            # transfer_to_human_agents.
            "ended_by": info.get("source"),
            "user_cost": info.get("user_cost"),
        },
        source_format=NAME,
    )


def from_file_name(stem: str) -> dict[str, str]:
    """The environment (the domain) and the model a file's name says."""
    model, _, domain = stem.rpartition("-")
    if domain not in _DOMAINS:
        return {}
    return {"env": domain, **({"model": model} if model else {})}


def _tool_error(content: str) -> str | None:
    return content if content.startswith("Error:") else None
