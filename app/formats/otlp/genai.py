"""The OpenTelemetry GenAI semantic conventions, in the forms instrumentations emit
today (docs/otlp.md has an example of each):

- current: `gen_ai.operation.name` chat / text_completion / generate_content /
  invoke_agent / execute_tool; messages as JSON in `gen_ai.input.messages`,
  `gen_ai.output.messages` and `gen_ai.system_instructions` (role + typed parts: text,
  tool_call, tool_call_response, reasoning); tools in `gen_ai.tool.name`,
  `gen_ai.tool.call.id`, `gen_ai.tool.call.arguments`, `gen_ai.tool.call.result`.
- older: one span event per message, `gen_ai.system.message`, `gen_ai.user.message`,
  `gen_ai.assistant.message`, `gen_ai.tool.message` and `gen_ai.choice`, their body
  in the event's attributes (`content`, `tool_calls`, `id`, `message`); and the
  `gen_ai.content.prompt` / `gen_ai.content.completion` events (`gen_ai.prompt`,
  `gen_ai.completion`: OpenAI messages as JSON).
- Logfire (`logfire.instrument_openai_agents()`): the same per-message events, as a
  JSON list in the span's `events` attribute (each with its `event.name`; the
  answer's messages last), or, for a Chat Completions model, `Chat completion with
  ...` spans whose `input` and `output` are OpenAI messages; tool runs are
  `Function: {name}` spans with `name`,
  `input`, `output` and, when the tool failed, `error` = `{"message", "data"}`.
- OpenLLMetry (Traceloop): indexed attributes `gen_ai.prompt.N.role` / `.content` /
  `.tool_calls.M.{id,name,arguments}` / `.tool_call_id`, and `gen_ai.completion.N.*`;
  tools offered as `llm.request.functions.N.{name,description,parameters}`.
"""

from __future__ import annotations

from typing import Any

from app.formats.otlp.conversation import ROLES, Call, Exchange, Message, ToolRun, text_of
from app.formats.otlp.spans import Span, failure
from app.formats.otlp.unflatten import decoded_json, indexed

MODEL_CALLS = {"chat", "text_completion", "generate_content"}
_LOGFIRE_TOOL = "Function: {name}"
_LOGFIRE_CHAT = "Chat completion with "
_MESSAGE_EVENTS = {
    "gen_ai.system.message": "system",
    "gen_ai.user.message": "user",
    "gen_ai.assistant.message": "assistant",
    "gen_ai.tool.message": "tool",
}


def exchange(span: Span) -> Exchange | None:
    """The model call (or agent invocation) a span records, if it carries messages."""
    a = span.attrs
    operation = a.get("gen_ai.operation.name")
    inputs: list[Message] = []
    outputs: list[Message] = []
    if "gen_ai.input.messages" in a or "gen_ai.output.messages" in a:
        inputs = _instructions(a.get("gen_ai.system_instructions"))
        inputs += _messages(decoded_json(a.get("gen_ai.input.messages")))
        outputs = _messages(decoded_json(a.get("gen_ai.output.messages")))[:1]
    elif "gen_ai.system_instructions" in a:
        inputs = _instructions(a["gen_ai.system_instructions"])
    elif any(key.startswith(("gen_ai.prompt.", "gen_ai.completion.")) for key in a):
        inputs = [m for m in map(_openllmetry, indexed(a, "gen_ai.prompt")) if m]
        outputs = [m for m in map(_openllmetry, indexed(a, "gen_ai.completion")) if m][:1]
    elif isinstance(logged := decoded_json(a.get("events")), list):
        inputs, outputs = _logfire_events(logged)
    elif _logfire_chat(span):
        inputs = chat_messages(decoded_json(a.get("input")))
        outputs = chat_messages(decoded_json(a.get("output")))[:1]
    else:
        inputs, outputs = _events(span)
    if not inputs and not outputs:
        return None
    if operation not in MODEL_CALLS | {"invoke_agent", None}:
        return None
    return Exchange(span.start, span.end, inputs, outputs, model=operation != "invoke_agent")


def tool_run(span: Span) -> ToolRun | None:
    a = span.attrs
    if a.get("logfire.msg_template") == _LOGFIRE_TOOL and isinstance(a.get("name"), str):
        return _logfire_tool(span)
    if a.get("gen_ai.operation.name") != "execute_tool":
        return None
    result = a.get("gen_ai.tool.call.result")
    return ToolRun(
        start=span.start,
        name=str(a.get("gen_ai.tool.name") or span.name),
        call_id=_str(a.get("gen_ai.tool.call.id")),
        arguments=decoded_json(a.get("gen_ai.tool.call.arguments")),
        result=text_of(result),
        error=_error(span),
    )


def tools(span: Span) -> list[Any]:
    """The tools a model call was offered: schemas where the span has them."""
    a = span.attrs
    offered: list[Any] = []
    definitions = decoded_json(a.get("gen_ai.tool.definitions"))
    if isinstance(definitions, list):
        offered += [d for d in definitions if isinstance(d, dict) and d.get("name")]
    for fn in indexed(a, "llm.request.functions"):
        if isinstance(fn.get("name"), str):
            schema = {"name": fn["name"]}
            if isinstance(fn.get("description"), str):
                schema["description"] = fn["description"]
            parameters = decoded_json(fn.get("parameters"))
            if isinstance(parameters, dict):
                schema["parameters"] = parameters
            offered.append(schema)
    return offered


def _error(span: Span) -> str | None:
    return failure(span)


def model_call(span: Span) -> bool:
    """A span that records a model call, whether or not it carries the messages."""
    operation = span.attrs.get("gen_ai.operation.name")
    return operation in MODEL_CALLS or _logfire_chat(span)


def _logfire_chat(span: Span) -> bool:
    """Logfire's span of an OpenAI Agents Chat Completions call: `input` and `output`
    hold the request's messages and the answer's, as OpenAI writes them."""
    template = span.attrs.get("logfire.msg_template")
    return isinstance(template, str) and template.startswith(_LOGFIRE_CHAT)


def _logfire_tool(span: Span) -> ToolRun:
    a = span.attrs
    error = decoded_json(a.get("error"))
    message = error.get("message") if isinstance(error, dict) else error
    return ToolRun(
        start=span.start,
        name=str(a["name"]),
        call_id=None,
        arguments=decoded_json(a.get("input")),
        result=text_of(a.get("output")),
        error=(str(message) if message else failure(span)) if error or span.failed else None,
    )


def _logfire_events(logged: list[Any]) -> tuple[list[Message], list[Message]]:
    """Logfire's `events`: the call's input messages, then its answer's."""
    said: list[Message] = []
    for body in logged:
        role = _MESSAGE_EVENTS.get(str(body.get("event.name"))) if isinstance(body, dict) else None
        if role is not None and isinstance(body, dict):
            said.append(_openai_message(body, role))
    answer = len(said)
    while answer > 0 and said[answer - 1].role == "assistant":
        answer -= 1
    return said[:answer], said[answer:]


# --- the current form: role + parts -------------------------------------------------


def _instructions(raw: Any) -> list[Message]:
    value = decoded_json(raw)
    if isinstance(value, str):
        return [Message("system", value)] if value.strip() else []
    if isinstance(value, list):
        text = _joined(part.get("content") for part in value
                       if isinstance(part, dict) and part.get("type", "text") == "text")
        return [Message("system", text)] if text else []
    return []


def _messages(value: Any) -> list[Message]:
    if not isinstance(value, list):
        return []
    out: list[Message] = []
    for raw in value:
        if isinstance(raw, dict):
            out.extend(_message(raw))
    return out


def _message(raw: dict[str, Any]) -> list[Message]:
    role = ROLES.get(str(raw.get("role", "")).lower())
    if role is None:
        return []
    parts = raw.get("parts")
    if not isinstance(parts, list):  # some emitters write OpenAI-style content
        return [_openai_message(raw, role)]
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[Call] = []
    results: list[Message] = []
    for part in parts:
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind == "text":
            texts.append(str(part.get("content") or ""))
        elif kind == "reasoning":
            reasoning.append(str(part.get("content") or ""))
        elif kind == "tool_call":
            calls.append(Call(str(part.get("name") or ""), part.get("arguments"),
                              _str(part.get("id"))))
        elif kind == "tool_call_response":
            # `response` in the conventions; PydanticAI writes `result`.
            said = part.get("response", part.get("result"))
            results.append(Message("tool", text=text_of(said), call_id=_str(part.get("id"))))
    if results:
        return results
    return [Message(role, _joined(texts), _joined(reasoning), calls)]


# --- the older forms: per-message events, OpenAI-style bodies -----------------------


def _events(span: Span) -> tuple[list[Message], list[Message]]:
    inputs: list[Message] = []
    outputs: list[Message] = []
    for event in span.events:
        body = _body(event.attrs)
        role = _MESSAGE_EVENTS.get(event.name)
        if role is not None:
            inputs.append(_openai_message(body, role))
        elif event.name == "gen_ai.choice" and not outputs and body.get("index", 0) in (0, "0"):
            message = decoded_json(body.get("message"))
            if isinstance(message, dict):
                outputs.append(_openai_message(message, "assistant"))
        elif event.name == "gen_ai.content.prompt":
            inputs += chat_messages(decoded_json(body.get("gen_ai.prompt")))
        elif event.name == "gen_ai.content.completion":
            outputs += chat_messages(decoded_json(body.get("gen_ai.completion")))[:1]
    return inputs, outputs


def _body(attrs: dict[str, Any]) -> dict[str, Any]:
    """An event's fields: its attributes, or the JSON object one of them carries."""
    for key in ("body", "event.body", "gen_ai.event.content"):
        body = decoded_json(attrs.get(key))
        if isinstance(body, dict):
            return body
    return attrs


def chat_messages(value: Any) -> list[Message]:
    if not isinstance(value, list):
        return []
    out = []
    for raw in value:
        role = ROLES.get(str(raw.get("role", "")).lower()) if isinstance(raw, dict) else None
        if role is not None:
            out.append(_openai_message(raw, role))
    return out


def _openai_message(raw: dict[str, Any], role: str) -> Message:
    """An OpenAI-style message body: content (text or parts), tool_calls, tool_call_id/id."""
    content = raw.get("content")
    if isinstance(content, list):
        content = _joined(part.get("text") for part in content if isinstance(part, dict))
    if role == "tool":
        return Message("tool", text=text_of(content),
                       call_id=_str(raw.get("tool_call_id") or raw.get("id")))
    calls = []
    listed = decoded_json(raw.get("tool_calls"))
    for call in listed if isinstance(listed, list) else []:
        if not isinstance(call, dict):
            continue
        fn = call["function"] if isinstance(call.get("function"), dict) else call
        calls.append(Call(str(fn.get("name") or ""), fn.get("arguments"), _str(call.get("id"))))
    return Message(role, text_of(content), calls=calls)


def _openllmetry(entry: dict[str, Any]) -> Message | None:
    role = ROLES.get(str(entry.get("role", "")).lower())
    if role is None:
        return None
    content = decoded_json(entry.get("content"))
    if isinstance(content, list):  # content parts, written as JSON
        content = _joined(p.get("text") for p in content if isinstance(p, dict))
    if role == "tool":
        return Message("tool", text=text_of(content), call_id=_str(entry.get("tool_call_id")))
    calls = [Call(str(c.get("name") or ""), c.get("arguments"), _str(c.get("id")))
             for c in entry.get("tool_calls") or [] if isinstance(c, dict)]
    legacy = entry.get("function_call")
    if isinstance(legacy, dict) and legacy.get("name"):
        calls.append(Call(str(legacy["name"]), legacy.get("arguments")))
    return Message(role, text_of(content), calls=calls)


def _joined(texts: Any) -> str | None:
    kept = [str(t) for t in texts if t is not None]
    return "\n".join(kept) if kept else None


def _str(value: Any) -> str | None:
    return None if value is None or value == "" else str(value)
