"""ShareGPT conversations, as Hermes Agent writes its trajectories:

    {"conversations": [{"from", "value"}], "completed"?, "model"?, "timestamp"?}

and as its batch_runner writes them (`prompt_index`, `metadata.model`, `completed`,
`partial`, `api_calls`, `toolsets_used`, `tool_stats`, `tool_error_counts`).

Parsing:
- `from` is system, human/user, gpt/assistant or tool/function/observation.
- A system turn holding a `<tools>[...]</tools>` list is Hermes' synthetic
  function-calling prompt, not something the agent was told: it gives the tool names
  (and schemas, kept in `metadata["tool_schemas"]`) and is not a step; text after
  the prompt's closing example is the agent's own system prompt (as `export_hermes`
  writes it), a message step. Other system turns are message steps.
- The first human turn is the task; later ones are message steps.
- gpt turns: each non-empty `<think>` block is a thought (Hermes pads every turn with
  an empty one); each `<tool_call>{json}</tool_call>` an action (bad JSON: an action
  whose arguments are the raw text); remaining text is said with the first call, or
  is a message; in the last gpt turn without calls it is the final answer.
- tool turns: one observation per `<tool_response>` block. Hermes writes no id in
  `<tool_call>`; the n-th response answers the n-th call, and its `tool_call_id`
  becomes both ids. The error is the non-null `error` inside `content`, else the
  top-level `error`, else `success: false`, else content starting with "Error:";
  `exit_code` comes from `content` (or the block). A tool turn without blocks is one
  observation.
- `completed` true/false is success/failure; absent, the `outcome`/`status` keys of
  `_common.reported_outcome` apply, else unknown. `partial: true` is the reason. A
  top-level `reward` (or `outcome.reward`) is the environment's reward; it never sets
  the status.

Exports, of the chat `_common.chat()` makes (one system turn, every tool turn right
after the gpt turn whose calls it answers): `export_hermes` writes what Hermes Agent
writes (one system turn: the synthetic prompt, whose `<tools>` lists the schemas the
trace carried or, when it carried none, those its calls imply, then the trace's own
system prompt; every gpt turn opening with a think block; merged tool turns;
`completed`); `export` writes plain ShareGPT with the same tags but none of Hermes'
envelope. Both carry the environment's reward, when there is one, as a
top-level `reward`.
"""

from __future__ import annotations

import json
from typing import Any

import re2  # type: ignore[import-untyped,import-not-found,unused-ignore]

from app.domain import Status, Trace
from app.errors import Invalid
from app.formats import _common as c
from app.formats.spec import Export, Format

NAME = "sharegpt"
_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
# RE2, not re: it searches what the model wrote, in time linear in its length.
_NAME = re2.compile(r"""["']name["']\s*:\s*["']([^"']+)["']""")
# batch_runner's per-run statistics, kept as metadata.
_RUN_KEYS = (
    "timestamp",
    "prompt_index",
    "partial",
    "api_calls",
    "toolsets_used",
    "tool_stats",
    "tool_error_counts",
)
_HERMES_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures "
    "within <tools> </tools> XML tags. You may call one or more functions to assist with "
    "the user query. If available tools are not relevant in assisting with user query, "
    "just respond in natural conversational language. Don't make assumptions about what "
    "values to plug into functions. After calling & executing the functions, you will be "
    "provided with function results within <tool_response> </tool_response> XML tags. "
    "Here are the available tools:\n<tools>\n{tools}\n</tools>\n"
    "For each function call return a JSON object, with the following pydantic model json "
    "schema for each:\n{{'title': 'FunctionCall', 'type': 'object', 'properties': "
    "{{'name': {{'title': 'Name', 'type': 'string'}}, 'arguments': {{'title': "
    "'Arguments', 'type': 'object'}}}}, 'required': ['name', 'arguments']}}\n"
    "Each function call should be enclosed within <tool_call> </tool_call> XML tags.\n"
    "Example:\n<tool_call>\n{{'name': <function-name>,'arguments': <args-dict>}}\n</tool_call>"
)
# Where the synthetic prompt ends: after it, export_hermes writes the agent's own.
_HERMES_END = "<args-dict>}\n</tool_call>"


def looks_like(item: dict[str, Any]) -> bool:
    return "conversations" in item


def parse(item: dict[str, Any]) -> Trace:
    env = c.envelope(item)
    for key in _RUN_KEYS:
        if item.get(key) is not None:
            env.metadata[key] = c.check_json(item[key], key)
    if env.agent["model"] is None:
        model = c.opt_str(item, "model") or env.metadata.get("model")
        env.agent["model"] = model if isinstance(model, str) else None
    turns = c.req_list(item, "conversations")
    task, steps, names = _turns(turns, env.metadata)
    c.promote_final(steps)
    return c.build(
        env, task=task, steps=steps, source_format=NAME, tools=names, outcome=_outcome(item)
    )


def export(trace: Trace) -> dict[str, Any]:
    """Plain ShareGPT: `conversations`, and the environment's `reward` if any."""
    return _with_reward({"conversations": _conversations(trace, hermes=False)}, trace)


def export_hermes(trace: Trace) -> dict[str, Any]:
    """One line of a Hermes Agent trajectory file."""
    prompt = _HERMES_PROMPT.format(tools=_hermes_tools(trace))
    conversations = _conversations(trace, hermes=True)
    if conversations and conversations[0]["from"] == "system":
        # One system turn: how to call the tools, then what the agent was told.
        prompt = f"{prompt}\n\n{conversations.pop(0)['value']}"
    system = {"from": "system", "value": prompt}
    body: dict[str, Any] = {"conversations": [system, *conversations]}
    if isinstance(trace.metadata.get("timestamp"), str):
        body["timestamp"] = trace.metadata["timestamp"]
    if trace.agent.model:
        body["model"] = trace.agent.model
    body["completed"] = trace.outcome.status is Status.SUCCESS
    return _with_reward(body, trace)


def _with_reward(body: dict[str, Any], trace: Trace) -> dict[str, Any]:
    if trace.outcome.reward is not None:
        body["reward"] = trace.outcome.reward
    return body


# --- parsing -----------------------------------------------------------------------


def _outcome(item: dict[str, Any]) -> dict[str, Any]:
    outcome = c.reported_outcome(item)
    completed = c.opt_bool(item, "completed")
    if completed is not None and outcome["status"] is Status.UNKNOWN:
        outcome["status"] = Status.SUCCESS if completed else Status.FAILURE
    if item.get("partial") is True and outcome.get("reason") is None:
        outcome["reason"] = "partial"
    return outcome


def _turns(
    raw: list[Any], metadata: dict[str, Any]
) -> tuple[str, list[c.StepDict], list[str] | None]:
    task: str | None = None
    names: list[str] | None = None
    steps: list[c.StepDict] = []
    pending: list[c.StepDict] = []  # the calls of the last gpt turn, awaiting their results
    for i, turn in enumerate(raw):
        where = f"conversations[{i}]"
        role, value = _turn(turn, where)
        if role == "tool":
            steps.extend(_results(value, pending, where))
            pending = []
            continue
        pending = []
        if role == "system" and names is None and (found := _tools_prompt(value)):
            names, schemas = found
            if schemas:
                metadata["tool_schemas"] = schemas
            end = value.find(_HERMES_END)
            own = value[end + len(_HERMES_END) :].strip() if end >= 0 else ""
            if own:
                steps.append(c.message("system", own))
        elif role == "system":
            steps.append(c.message("system", value))
        elif role == "user" and task is None:
            task = value
        elif role == "user":
            steps.append(c.message("user", value))
        else:
            turn_steps, pending = _gpt(value, where)
            steps.extend(turn_steps)
    return task or "", steps, names


def _turn(turn: Any, where: str) -> tuple[str, str]:
    obj = c.as_dict(turn, where)
    # Some ShareGPT writers use OpenAI's key names inside `conversations`.
    source_key = "role" if "from" not in obj and "role" in obj else "from"
    source = c.req_str(obj, source_key, where)
    role = _ROLES.get(source.strip().lower())
    if role is None:
        c.fail(
            c.path(where, source_key),
            f"unknown speaker {source!r}; one of {', '.join(_ROLES)}"[:300],
        )
    value_key = "value" if "value" in obj else "content"
    return role, c.text_content(obj.get(value_key), c.path(where, value_key)) or ""


def _tools_prompt(value: str) -> tuple[list[str], list[dict[str, Any]]] | None:
    listed = c.loads(_tools_block(value))
    if not isinstance(listed, list):
        return None
    try:
        return c.tools(listed, "tools")
    except Invalid:
        return None  # not Hermes' prompt after all: keep the turn as a message


def _tools_block(value: str) -> str:
    """The text of the first `<tools>` block that holds a list. Hermes' prompt first
    mentions "<tools> </tools> XML tags" in prose, so the first pair may be empty.
    (str.find, not a regex: the prompt runs to tens of kilobytes.)"""
    start = value.find("<tools>")
    while start != -1:
        end = value.find("</tools>", start)
        if end == -1:
            break
        body = value[start + len("<tools>") : end].strip()
        if body.startswith("["):
            return body
        start = value.find("<tools>", end)
    return ""


def _gpt(value: str, where: str) -> tuple[list[c.StepDict], list[c.StepDict]]:
    thoughts, rest = c.split_think(value)
    steps = [c.thought(t) for t in thoughts]
    calls, text = c.tag_blocks(rest, "<tool_call>", "</tool_call>")
    actions = [_call(raw.strip(), where) for raw in calls]
    text = text.strip()
    if actions and text:
        actions[0]["content"] = text
    elif text:
        steps.append(c.message("assistant", text))
    return steps + actions, actions


def _call(raw: str, where: str) -> c.StepDict:
    call = c.loads(raw)
    if isinstance(call, dict) and isinstance(call.get("name"), str):
        args = call.get("arguments")
        if args is None or isinstance(args, (str, dict)):
            call_id = call.get("id")
            return c.action(
                call["name"],
                c.arguments(args, where),
                call_id if isinstance(call_id, str) else None,
            )
    # The model wrote something that is not a call: keep it as written, so the reward
    # rules can see an invalid tool call rather than none.
    name = _NAME.search(raw)
    return c.action(name.group(1) if name else None, raw, None)


def _results(value: str, pending: list[c.StepDict], where: str) -> list[c.StepDict]:
    blocks = [b.strip() for b in c.tag_blocks(value, "<tool_response>", "</tool_response>")[0]]
    if not blocks:
        call_id = pending[0]["call_id"] if len(pending) == 1 else None
        return [c.observation(call_id, value, c.error_from_text(value))]
    results = []
    for k, raw in enumerate(blocks):
        call = pending[k] if k < len(pending) else None
        obs = _result(raw, call["call_id"] if call else None, where)
        if call is not None and call["call_id"] is None:
            call["call_id"] = obs["call_id"]
        results.append(obs)
    return results


def _result(raw: str, call_id: str | None, where: str) -> c.StepDict:
    block = c.loads(raw)
    if not isinstance(block, dict):
        return c.observation(call_id, raw, c.error_from_text(raw))
    # Hermes wraps the output as {"tool_call_id", "name", "content"}; other writers put
    # the output object itself in the block.
    inner = block.get("content") if "content" in block else block
    found_id = block.get("tool_call_id")
    content = inner if inner is None or isinstance(inner, str) else c.dumps(inner, where)
    details = inner if isinstance(inner, dict) else {}
    return c.observation(
        found_id if isinstance(found_id, str) else call_id,
        content,
        _error(details, block, inner, where),
        _exit_code(details, block),
    )


def _error(details: dict[str, Any], block: dict[str, Any], inner: Any, where: str) -> str | None:
    for value in (details.get("error"), block.get("error")):
        if value is True:
            return "error"
        if isinstance(value, str) and value:
            return value
        if value not in (None, False, ""):
            return c.dumps(value, where)
    if details.get("success") is False or block.get("success") is False:
        return "error"
    return c.error_from_text(inner) if isinstance(inner, str) else None


def _exit_code(details: dict[str, Any], block: dict[str, Any]) -> int | None:
    # Not `or`: 0 is the commonest exit code. A malformed one is the tool's output,
    # not ours to refuse, so it is ignored.
    code = c.as_exit_code(details.get("exit_code"))
    return code if code is not None else c.as_exit_code(block.get("exit_code"))


# --- export ------------------------------------------------------------------------


def _conversations(trace: Trace, *, hermes: bool) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    for turn in c.chat(trace):
        if turn.role != "assistant":
            out.append(
                {"from": "human" if turn.role == "user" else turn.role, "value": turn.text or ""}
            )
            continue
        if turn.thought is not None or turn.text is not None or turn.actions:
            out.append({"from": "gpt", "value": _gpt_value(turn, hermes)})
        if turn.observations:
            out.append({"from": "tool", "value": _tool_value(turn)})
    return out


def _gpt_value(turn: c.Turn, hermes: bool) -> str:
    value = ""
    if turn.thought is not None or hermes:
        value = f"<think>\n{turn.thought}\n</think>\n" if turn.thought else "<think>\n</think>\n"
    value += turn.text or ""
    for action in turn.actions:
        if value and not value.endswith("\n"):
            value += "\n"
        call = {"name": action.tool or "", "arguments": action.arguments or {}}
        value += f"<tool_call>\n{_json(call)}\n</tool_call>\n"
    return value.rstrip() if turn.actions else value.strip()


def _tool_value(turn: c.Turn) -> str:
    blocks = []
    for obs, call_id in zip(turn.observations, turn.result_ids):
        block: dict[str, Any] = {
            "tool_call_id": call_id,
            "name": turn.tool_of(call_id),
            "content": _content_value(obs.content),
        }
        # Say what the content itself does not: a re-parse must find the same values.
        derived = _result(_json(block), call_id, "")
        if obs.error != derived["error"] and obs.error is not None:
            block["error"] = obs.error
        if obs.exit_code != derived["exit_code"] and obs.exit_code is not None:
            block["exit_code"] = obs.exit_code
        blocks.append(f"<tool_response>\n{_json(block)}\n</tool_response>")
    return "\n".join(blocks)


def _content_value(content: str | None) -> Any:
    """Hermes embeds tool output that is JSON as JSON, else as a string."""
    if content and content.lstrip()[:1] in ("{", "["):
        parsed = c.loads(content)
        if parsed is not c.NOT_JSON:
            return parsed
    return content


def _hermes_tools(trace: Trace) -> str:
    listed = [
        {
            "name": schema["function"].get("name"),
            "description": schema["function"].get("description", ""),
            "parameters": schema["function"].get("parameters", {}),
            "required": None,
        }
        for schema in c.openai_tools(trace)
    ]
    return _json(listed)


def _json(value: Any) -> str:
    # Hermes writes json.dumps(..., ensure_ascii=False): spaced separators, raw unicode.
    return json.dumps(value, ensure_ascii=False)


FORMAT = Format(
    NAME,
    parse,
    looks_like,
    detected_by="'conversations'",
    aliases=("hermes",),
    step_lists=("conversations",),
    exports=(Export(NAME, export), Export("hermes", export_hermes)),
)
