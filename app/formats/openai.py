"""OpenAI chat messages: `{"messages": [...], "tools"?}`, as chat-completions logs and
fine-tuning files hold them.

Parsing:
- roles system (and developer), user, assistant, tool, and the legacy function;
  content is a string, null, or a list of `{"type": "text", "text"}` parts.
- The first user message is the task, not a step; later ones are message steps.
- Assistant `reasoning_content` or `reasoning`, and any inline `<think>` block,
  become thought steps; `tool_calls` (and legacy `function_call`) become actions,
  their `arguments` string parsed when it is a JSON object, else kept as written.
  Text said alongside tool calls is the first action's `content`.
- The last assistant message, when it calls no tool, is the final step.
- tool / function messages are observations (`call_id` = `tool_call_id`); content
  starting with "Error:" is the error.
- `tools` (or legacy `functions`) give the tool names; `model` the agent's model.
- Outcome: `outcome` (as in native) or `status` at the top level; the environment's
  reward as `outcome.reward` or a top-level `reward`. A reward never makes a status:
  without one it is unknown (see `_common.reported_outcome`).

Export is one fine-tuning record `{"messages", "tools"?}` that trainers load as it
is: the chat of `_common.chat()` (one system message first; every `tool` message
answers a call of the assistant message before it, by `tool_call_id`), assistant
`tool_calls` with `arguments` as a JSON string. The record ends on an assistant
message: what follows the model's last turn (its last results, the user's thanks)
is trimmed; a trace with no assistant turn at all cannot be a training record
(`Unexportable`). `tools` are the schemas the trace carried, or those its calls imply
(`_common.openai_tools`). Reasoning goes in `reasoning_content` (the key vLLM,
DeepSeek and Atropos' Hermes environments use) so that thoughts survive the trip; a
validator that allows only OpenAI's own message keys needs that key dropped.

The `messages` export is the same record in the shape Hugging Face chat templates
(`transformers`' `apply_chat_template`, TRL) take: each call's `arguments` is the JSON
object itself, not its text (the templates write it with `tojson`, or walk its items,
so text would be encoded twice or fail), and every tool schema has a `description`
(some templates print it unguarded); where the trace recorded none it is empty, as a
description the agent never showed its model would be invented. A call whose
arguments are not a JSON object has no such shape: the trace is `Unexportable`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.domain import Step, Trace
from app.errors import Unexportable
from app.formats import _common as c
from app.formats.spec import Export, Format

NAME = "openai"
_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def looks_like(item: dict[str, Any]) -> bool:
    return "messages" in item


def parse(item: dict[str, Any]) -> Trace:
    env = c.envelope(item)
    if env.agent["model"] is None:
        env.agent["model"] = c.opt_str(item, "model")
    names: list[str] | None = None
    for key in ("tools", "functions"):
        if item.get(key) is not None:
            names, schemas = c.tools(item[key], key)
            if schemas:
                env.metadata["tool_schemas"] = schemas
            break
    outcome = c.reported_outcome(item)
    task, steps = _messages(c.req_list(item, "messages"))
    c.promote_final(steps)
    return c.build(env, task=task, steps=steps, source_format=NAME, tools=names, outcome=outcome)


def export(trace: Trace) -> dict[str, Any]:
    return _record(trace, _arguments_text)


def export_messages(trace: Trace) -> dict[str, Any]:
    """The record as chat templates take it (see the module's doc)."""
    record = _record(trace, _arguments_object)
    if "tools" in record:
        record["tools"] = [
            {**tool, "function": {**tool["function"],
                                  "description": tool["function"].get("description") or ""}}
            for tool in record["tools"]
        ]
    return record


def _record(trace: Trace, arguments: Callable[[Step], Any]) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    for turn in c.chat(trace):
        if turn.role != "assistant":
            messages.append({"role": turn.role, "content": turn.text or ""})
            continue
        messages.append(_assistant(turn, arguments))
        messages += [
            {"role": "tool", "tool_call_id": call_id, "content": c.result_text(obs)}
            for obs, call_id in zip(turn.observations, turn.result_ids)
        ]
    # A record ends on the model's last turn: nothing after it is trained on.
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    if not messages:
        raise Unexportable("no assistant turn: nothing in the trace for a model to learn")
    record: dict[str, Any] = {"messages": messages}
    tools = c.openai_tools(trace)
    if tools:
        record["tools"] = tools
    return record


def _messages(raw: list[Any]) -> tuple[str, list[c.StepDict]]:
    task: str | None = None
    steps: list[c.StepDict] = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        obj = c.as_dict(msg, where)
        role = c.req_str(obj, "role", where)
        content = c.text_content(obj.get("content"), c.path(where, "content"))
        if role in ("system", "developer"):
            steps.append(c.message("system", content or ""))
        elif role == "user":
            if task is None:
                task = content or ""
            else:
                steps.append(c.message("user", content or ""))
        elif role == "assistant":
            steps.extend(_assistant_steps(obj, content, where))
        elif role in ("tool", "function"):
            call_id = c.opt_str(obj, "tool_call_id", where)
            steps.append(c.observation(call_id, content, c.error_from_text(content)))
        else:
            c.fail(c.path(where, "role"), f"unknown role {role!r}; one of {', '.join(_ROLES)}")
    return task or "", steps


def _assistant_steps(obj: dict[str, Any], content: str | None, where: str) -> list[c.StepDict]:
    steps: list[c.StepDict] = []
    # Providers write one or the other; when both are there they hold the same text.
    reasoning = c.opt_str(obj, "reasoning_content", where) or c.opt_str(obj, "reasoning", where)
    if reasoning and reasoning.strip():
        steps.append(c.thought(reasoning.strip()))
    thoughts, text = c.split_think(content or "")
    steps.extend(c.thought(t) for t in thoughts)
    text = text.strip() if thoughts else text
    actions = _tool_calls(obj, where)
    if actions and c.has_text(text):
        actions[0]["content"] = text
    elif c.has_text(text):
        steps.append(c.message("assistant", text))
    return steps + actions


def _tool_calls(obj: dict[str, Any], where: str) -> list[c.StepDict]:
    calls = c.opt_list(obj, "tool_calls", where) or []
    actions: list[c.StepDict] = []
    for j, call in enumerate(calls):
        call_where = c.path(c.path(where, "tool_calls"), j)
        call_obj = c.as_dict(call, call_where)
        fn_where = c.path(call_where, "function")
        fn = c.as_dict(call_obj.get("function"), fn_where)
        actions.append(
            c.action(
                c.req_str(fn, "name", fn_where),
                c.arguments(fn.get("arguments"), c.path(fn_where, "arguments")),
                c.opt_str(call_obj, "id", call_where),
            )
        )
    legacy = c.opt_dict(obj, "function_call", where)
    if legacy is not None:
        fn_where = c.path(where, "function_call")
        actions.append(
            c.action(
                c.req_str(legacy, "name", fn_where),
                c.arguments(legacy.get("arguments"), c.path(fn_where, "arguments")),
                None,
            )
        )
    return actions


def _assistant(turn: c.Turn, arguments: Callable[[Step], Any]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant"}
    if turn.text is not None or not turn.actions:
        msg["content"] = turn.text or ""
    if turn.thought is not None:
        msg["reasoning_content"] = turn.thought
    if turn.actions:
        msg["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": action.tool or "", "arguments": arguments(action)},
            }
            for action, call_id in zip(turn.actions, turn.call_ids)
        ]
    return msg


def _arguments_text(action: Step) -> str:
    if isinstance(action.arguments, str):
        return action.arguments
    return c.dumps({} if action.arguments is None else action.arguments)


def _arguments_object(action: Step) -> dict[str, Any]:
    if action.arguments is None:
        return {}
    if not isinstance(action.arguments, dict):
        kind = c.type_name(action.arguments)
        raise Unexportable("a tool call whose arguments are not a JSON object: "
                           f"{action.tool or 'a tool'} was called with {kind}")
    return action.arguments


FORMAT = Format(
    NAME,
    parse,
    looks_like,
    detected_by="'messages'",
    step_lists=("messages",),
    exports=(Export(NAME, export), Export("messages", export_messages)),
)
