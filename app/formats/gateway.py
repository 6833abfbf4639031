"""Gateway rollouts: the model calls of one rollout, captured by the hub's model
endpoint (app/gateway), as one trajectory.

    {"format": "gateway", "rollout_id", "calls": [CALL, ...], "finish": {...} | null}

Each CALL is the capture app/gateway/calls.py describes, in the order the calls
started. A call's `request.messages` is stored once: when it begins with the previous
chat call's messages, as `{"after": i, "then": [...]}` (the messages of call i,
then these), expanded again on reading (`messages_of`), so a long run is not
stored once per call.

Parsing makes the conversation once, in order, however often each call repeated it:
each chat call's messages past what the conversation already holds, then its answer;
the first user message is the task. When a call's messages do not begin with the
conversation so far (an agent that edits its history), the new messages are appended
and `metadata.gateway.edited_at_call` says at which call. A completion call's prompt is
a user message (or, continuing the previous prompt and completion, what it adds), its
text the assistant's. A Responses API call's `instructions` and `input` are its
messages (`previous_response_id`: its input continues the conversation), its output's
messages and function calls the answer; a call holding an item that maps to no chat
message (an image, a built-in tool) adds nothing but its capture. `finish` gives the
outcome: `reward` (the environment's), `status`, `task` (replaces the first user
message as the task), `group` (the group of rollouts it belongs to, as
`metadata.group`: app/targets/atropos.py) and `metadata`.

Per call, `metadata.gateway.calls` keeps its model asked for and answered by, policy
version, latency, time to first byte, usage, finish reason, status and error, and
whether token ids came with it; the ids themselves are in the original (the tokens
view, app/gateway/tokens.py).
"""

from __future__ import annotations

from typing import Any

from app.domain import Trace
from app.formats import _common as c
from app.formats import openai
from app.formats.spec import Format
from app.formats.stitching import as_seen

NAME = "gateway"


def document(rollout_id: str, calls: list[dict[str, Any]],
             finish: dict[str, Any] | None) -> dict[str, Any]:
    """The trajectory's original: the calls, each chat call's messages stored past the
    previous chat call's when they begin with them."""
    stored: list[dict[str, Any]] = []
    previous: tuple[int, list[Any]] | None = None
    for i, call in enumerate(calls):
        messages = messages_of([call])[0]
        if messages is not None and previous is not None:
            at, before = previous
            if len(messages) >= len(before) and messages[: len(before)] == before:
                request = {**call["request"],
                           "messages": {"after": at, "then": messages[len(before):]}}
                call = {**call, "request": request}
        if messages is not None:
            previous = (i, messages)
        stored.append(call)
    return {"format": NAME, "rollout_id": rollout_id, "calls": stored, "finish": finish}


def messages_of(calls: list[dict[str, Any]]) -> list[list[Any] | None]:
    """Each call's request messages, whole (None for a call that has none)."""
    out: list[list[Any] | None] = []
    for call in calls:
        request = call["request"] if isinstance(call.get("request"), dict) else {}
        messages = request.get("messages")
        if isinstance(messages, dict) and isinstance(messages.get("after"), int):
            at = messages["after"]
            before = out[at] if 0 <= at < len(out) else None
            messages = [*(before or []), *(messages.get("then") or [])]
        out.append(messages if isinstance(messages, list) else None)
    return out


def parse(item: dict[str, Any]) -> Trace:
    rollout_id = c.req_str(item, "rollout_id")
    calls = [c.as_dict(call, f"calls[{i}]") for i, call in
             enumerate(c.req_list(item, "calls"))]
    if not calls:
        c.fail("calls", "holds no call: nothing to make a trajectory of")
    finish = c.opt_dict(item, "finish") or {}
    conversation, edited = _conversation(calls)
    if not conversation:
        c.fail("calls", f"the calls of rollout {rollout_id} carry no messages or prompts")
    answered = [call for call in calls if isinstance(call.get("response"), dict)]
    last = answered[-1] if answered else calls[-1]
    gateway: dict[str, Any] = {"calls": [_summary(call) for call in calls]}
    if edited is not None:
        gateway["edited_at_call"] = edited
    metadata = dict(c.opt_dict(finish, "metadata", "finish") or {})
    group = c.opt_str(finish, "group", "finish")
    if group is not None:
        metadata["group"] = group
    metadata["gateway"] = gateway
    record: dict[str, Any] = {
        "trace_id": rollout_id,
        "messages": conversation,
        "agent": {"model": c.opt_str(last, "model")},
        "policy_version": _last(calls, "policy_version"),
        "metadata": metadata,
    }
    tools = _last_request(calls, "tools")
    if tools is not None:
        record["tools"] = tools
    if finish.get("status") is not None:
        record["status"] = finish["status"]
    if finish.get("reward") is not None:
        record["reward"] = finish["reward"]
    trace = openai.parse(record)
    update: dict[str, Any] = {"source_format": NAME}
    task = c.opt_str(finish, "task", "finish")
    if task is not None:
        update["task"] = task
    return trace.model_copy(update=update)


def _conversation(calls: list[dict[str, Any]]) -> tuple[list[Any], int | None]:
    conversation: list[Any] = []
    edited: int | None = None
    prompt_so_far: str | None = None
    for i, (call, messages) in enumerate(zip(calls, messages_of(calls))):
        answer = _answer(call)
        if call.get("kind") == "responses":
            given = _responses_input(call)
            if given is None:
                continue
            messages, continued = given
            if continued:
                messages = [*conversation, *messages]
        if call.get("kind") == "completion":
            prompt = _prompt(call)
            if prompt is None:
                continue
            if prompt_so_far is not None and prompt.startswith(prompt_so_far):
                added = prompt[len(prompt_so_far):]
                if added:
                    conversation.append({"role": "user", "content": added})
            else:
                conversation.append({"role": "user", "content": prompt})
            text = answer if isinstance(answer, str) else ""
            conversation.append({"role": "assistant", "content": text})
            prompt_so_far = prompt + text
            continue
        if messages is None:
            continue
        held = _held(conversation, messages)
        if held < len(conversation) and edited is None:
            edited = i
        conversation.extend(messages[held:])
        if isinstance(answer, dict):
            conversation.append(_clean(answer))
    return conversation, edited


def _held(conversation: list[Any], messages: list[Any]) -> int:
    """How many of `messages` the conversation already holds: the longest common
    prefix, messages compared as the model saw them."""
    n = 0
    for had, new in zip(conversation, messages):
        if as_seen(had) != as_seen(new):
            break
        n += 1
    return n


def _clean(message: dict[str, Any]) -> dict[str, Any]:
    """An answer as a chat message: the keys the openai format reads."""
    keep = ("role", "content", "tool_calls", "reasoning_content", "reasoning")
    return {k: v for k, v in message.items() if k in keep and v is not None} | {
        "role": "assistant"}


def _answer(call: dict[str, Any]) -> dict[str, Any] | str | None:
    response = call.get("response")
    if not isinstance(response, dict):
        return None
    choices = response.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        first = choices[0]
        if call.get("kind") == "completion":
            return str(first.get("text") or "")
        message = first.get("message")
        return message if isinstance(message, dict) else None
    if call.get("kind") == "responses":
        said = _responses_items(response.get("output") or [])
        if not said or any(m.get("role") != "assistant" for m in said):
            return None
        answered: dict[str, Any] = {"role": "assistant", "content": None}
        for m in said:
            if m.get("content"):
                answered["content"] = (answered["content"] or "") + m["content"]
            answered.setdefault("tool_calls", []).extend(m.get("tool_calls") or [])
        if not answered["tool_calls"]:
            del answered["tool_calls"]
        return answered
    return None


def _responses_input(call: dict[str, Any]) -> tuple[list[Any], bool] | None:
    """A Responses API call's messages, and whether they continue the conversation so
    far: with `previous_response_id` the upstream keeps the conversation and the input
    is what comes next; else the instructions are the system message, then the input.
    None when an item maps to no chat message."""
    request = call["request"] if isinstance(call.get("request"), dict) else {}
    given = request.get("input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else given
    if not isinstance(items, list):
        return None
    said = _responses_items(items)
    if said is None:
        return None
    if request.get("previous_response_id"):
        return said, True
    instructions = request.get("instructions")
    if isinstance(instructions, str) and instructions:
        said.insert(0, {"role": "system", "content": instructions})
    return said, False


def _responses_items(items: list[Any]) -> list[dict[str, Any]] | None:
    """Responses API items as chat messages: messages (their text parts), function
    calls (an assistant message's tool calls) and their outputs (tool messages);
    reasoning items stay in the capture only, as they do when resent."""
    said: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict):
            return None
        kind = item.get("type", "message")
        if kind == "message" and isinstance(item.get("role"), str):
            content = item.get("content")
            if isinstance(content, list):
                texts = [part.get("text") for part in content if isinstance(part, dict)]
                if not all(isinstance(t, str) for t in texts):
                    return None  # an image, a file: no chat text holds it
                content = "".join(t for t in texts if isinstance(t, str))
            if not isinstance(content, str):
                return None
            said.append({"role": item["role"], "content": content})
        elif kind == "function_call":
            called = {"id": item.get("call_id"), "type": "function",
                      "function": {"name": item.get("name"),
                                   "arguments": item.get("arguments")}}
            last = said[-1] if said else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(called)
            else:
                said.append({"role": "assistant", "content": None, "tool_calls": [called]})
        elif kind == "reasoning":
            continue  # the model's own reasoning, opaque (encrypted) or summarised: in the capture
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                return None
            said.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": output})
        else:
            return None
    return said


def _prompt(call: dict[str, Any]) -> str | None:
    request = call["request"] if isinstance(call.get("request"), dict) else {}
    prompt = request.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def _summary(call: dict[str, Any]) -> dict[str, Any]:
    keys = ("kind", "stream", "model", "upstream_model", "answered_by", "policy_version",
            "status", "latency_ms", "first_byte_ms", "usage", "finish_reason",
            "disconnected", "tokens_withheld")
    out = {k: call.get(k) for k in keys if call.get(k) is not None}
    out["token_ids"] = bool(call.get("prompt_token_ids") or call.get("token_ids"))
    if call.get("error") is not None:
        out["error"] = call["error"]
    return out


def _last(calls: list[dict[str, Any]], key: str) -> Any:
    return next((call[key] for call in reversed(calls) if call.get(key) is not None), None)


def _last_request(calls: list[dict[str, Any]], key: str) -> Any:
    for call in reversed(calls):
        request = call.get("request")
        if isinstance(request, dict) and request.get(key) is not None:
            return request[key]
    return None


FORMAT = Format(NAME, parse, None, step_lists=())
