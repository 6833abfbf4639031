"""OpenInference (Arize; smolagents, LlamaIndex, LangChain, the OpenAI and Anthropic
clients, ...): `openinference.span.kind` LLM / TOOL / AGENT / CHAIN.

- LLM: `llm.input_messages.N.message.{role, content, contents.M.message_content.text,
  tool_calls.M.tool_call.{id, function.name, function.arguments}, tool_call_id}` and
  `llm.output_messages.N.message.*`; `llm.model_name`; `llm.tools.N.tool.json_schema`.
- TOOL: `tool.name`, the call's id in `tool_call.id` where the instrumentation sets
  it, its arguments in `tool_call.function.arguments` or `input.value`, its result in
  `output.value`.
- AGENT / CHAIN: `input.value` and `output.value`, the run's task and answer when no
  model call carried them; `agent.name`.
"""

from __future__ import annotations

from typing import Any

from app.formats.otlp.conversation import ROLES, Call, Exchange, Message, ToolRun, text_of
from app.formats.otlp.spans import Span
from app.formats.otlp.unflatten import decoded_json, indexed

KIND = "openinference.span.kind"
# input.value keys that hold the task, for agents that send their inputs as JSON.
_TASK_KEYS = ("task", "input", "query", "question", "prompt", "message")


def kind(span: Span) -> str | None:
    value = span.attrs.get(KIND)
    return value.upper() if isinstance(value, str) else None


def exchange(span: Span) -> Exchange | None:
    if kind(span) != "LLM":
        return None
    inputs = [m for e in indexed(span.attrs, "llm.input_messages") for m in _message(e)]
    outputs = [m for e in indexed(span.attrs, "llm.output_messages") for m in _message(e)]
    if not inputs and not outputs:
        return None
    return Exchange(span.start, span.end, inputs, outputs[:1])


def tool_run(span: Span) -> ToolRun | None:
    if kind(span) != "TOOL":
        return None
    a = span.attrs
    arguments = a.get("tool_call.function.arguments", a.get("input.value"))
    return ToolRun(
        start=span.start,
        name=str(a.get("tool.name") or a.get("tool_call.function.name") or span.name),
        call_id=_str(a.get("tool_call.id")),
        arguments=decoded_json(arguments),
        result=text_of(a.get("output.value")),
        error=(span.status_message or "the tool failed") if span.failed else None,
    )


def tools(span: Span) -> list[Any]:
    offered: list[Any] = []
    for entry in indexed(span.attrs, "llm.tools"):
        tool = entry.get("tool")
        schema = decoded_json(tool.get("json_schema")) if isinstance(tool, dict) else None
        if isinstance(schema, dict):
            offered.append(schema)
    return offered


def task(span: Span) -> str | None:
    """An AGENT or CHAIN span's input, as the run's task."""
    value = decoded_json(span.attrs.get("input.value"))
    if isinstance(value, dict):
        for key in _TASK_KEYS:
            if isinstance(value.get(key), str):
                return str(value[key])
    return text_of(value)


def answer(span: Span) -> str | None:
    return text_of(decoded_json(span.attrs.get("output.value")))


def _message(entry: dict[str, Any]) -> list[Message]:
    raw = entry.get("message")
    if not isinstance(raw, dict):
        return []
    role = ROLES.get(str(raw.get("role", "")).lower())
    if role is None:
        return []
    content = raw.get("content")
    if content is None and isinstance(raw.get("contents"), list):
        texts = [c["message_content"].get("text") for c in raw["contents"]
                 if isinstance(c, dict) and isinstance(c.get("message_content"), dict)]
        content = "\n".join(t for t in texts if isinstance(t, str)) or None
    if role == "tool":
        return [Message("tool", text=text_of(content), call_id=_str(raw.get("tool_call_id")))]
    calls = []
    for item in raw.get("tool_calls") or []:
        call = item.get("tool_call") if isinstance(item, dict) else None
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            calls.append(Call(str(fn.get("name") or ""), fn.get("arguments"),
                              _str(call.get("id") if isinstance(call, dict) else None)))
    return [Message(role, text_of(content), calls=calls)]


def _str(value: Any) -> str | None:
    return None if value is None or value == "" else str(value)
