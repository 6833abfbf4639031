"""ToolBench DFSDT answers: `{win, tree, forward_args, compare_candidates,
answer_generation}`.

One trace per file. `answer_generation.train_messages` holds growing prefixes of the
one chain the search settled on (one training example per assistant turn), so its
last chain is the whole trajectory; the earlier ones are not separate attempts. When
there is no valid chain (`valid_data: false`, no train_messages) the trace is the
deepest branch of the search `tree`, which is what the agent last tried.

Success is `win`. A `function` result whose JSON `error` is non-empty is a tool
error. The model ends every chain with a call to `Finish` (its system prompt says to):
`return_type: give_answer` with its `final_answer`, or `give_up_and_restart`. That
call is kept as the model wrote it, as its last step: the environment answers nothing
to it (the search stops), so it has no result, and its answer is not repeated as an
assistant text the model never wrote.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import orjson

from app.domain import Outcome, Status, Step, Trace
from app.import_sources._common import (
    CallIds,
    action,
    chat_steps,
    observation,
    parse_arguments,
    take_task,
    thought,
)

NAME = "toolbench"

# Function results are sometimes cut short and no longer parse; the error field
# comes first, so it can still be read.
_ERROR_FIELD = re.compile(r'^\s*\{\s*"error"\s*:\s*"((?:[^"\\]|\\.)*)"')


def looks_like(obj: Any) -> bool:
    return isinstance(obj, dict) and "answer_generation" in obj and ("win" in obj or "tree" in obj)


def parse(obj: dict[str, Any]) -> Iterator[Trace]:
    generation = obj["answer_generation"]
    chains = generation.get("train_messages") or []
    if chains:
        first_user, messages = take_task(chains[-1])
        steps = list(chat_steps(messages, tool_error=_tool_error))
    else:
        first_user, steps = "", list(_tree_steps(obj.get("tree") or {}))
    win = bool(obj.get("win"))
    yield Trace(
        task=generation.get("query") or first_user.strip(),
        tools=[f["name"] for f in generation.get("function") or []] or None,
        steps=steps,
        outcome=Outcome(
            status=Status.SUCCESS if win else Status.FAILURE, reason=_reason(win, generation)
        ),
        metadata={
            "win": win,
            "valid_data": generation.get("valid_data"),
            "finish_type": generation.get("finish_type"),
            "query_count": generation.get("query_count"),
            "total_tokens": generation.get("total_tokens"),
            "from": "train_messages" if chains else "tree",
        },
        source_format=NAME,
    )


def _reason(win: bool, generation: dict[str, Any]) -> str:
    if win:
        return "win"
    if generation.get("valid_data") is False:
        return "no valid answer chain (valid_data false)"
    return f"not a win (finish_type {generation.get('finish_type')})"


def _tool_error(content: str) -> str | None:
    try:
        decoded = orjson.loads(content)
    except orjson.JSONDecodeError:
        match = _ERROR_FIELD.match(content)
        return (match.group(1) or None) if match else None
    error = decoded.get("error") if isinstance(decoded, dict) else None
    return str(error) if error else None


def _tree_steps(tree: dict[str, Any]) -> Iterator[Step]:
    """The deepest root-to-leaf branch of the DFSDT tree, as steps. Nodes come as
    Thought, Action (the tool name), Action Input (its arguments and observation)."""
    ids = CallIds()
    tool: str | None = None
    for node in _deepest_branch(tree.get("tree") or {}):
        kind, text = node.get("node_type"), node.get("description") or ""
        if kind == "Thought":
            yield thought(text)
        elif kind == "Action":
            tool = text
        elif kind == "Action Input" and tool is not None:
            yield action(tool, parse_arguments(text), ids.new())
            if node.get("observation") is not None:
                result = str(node["observation"])
                yield observation(result, call_id=ids.last, error=_tool_error(result))
            tool = None


def _deepest_branch(node: dict[str, Any]) -> list[dict[str, Any]]:
    # The first deepest branch: DFSDT explores children in order, so on ties the
    # earlier one is what the search tried first.
    best: list[dict[str, Any]] = []
    for child in node.get("children") or []:
        branch = _deepest_branch(child)
        if len(branch) > len(best):
            best = branch
    return [node, *best]
