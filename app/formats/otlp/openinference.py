"""OpenInference (Arize; smolagents, LlamaIndex, LangChain, the OpenAI and Anthropic
clients, ...): `openinference.span.kind` LLM / TOOL / AGENT / CHAIN.

- LLM: `llm.input_messages.N.message.{role, content, contents.M.message_content.text,
  tool_calls.M.tool_call.{id, function.name, function.arguments}, tool_call_id}` and
  `llm.output_messages.N.message.*`; `llm.model_name`; `llm.tools.N.tool.json_schema`.
- TOOL: `tool.name`, the call's id in `tool_call.id` where the instrumentation sets
  it, else inside `output.value` (LangChain's serialised ToolMessage names it in
  `data.tool_call_id`); its arguments in `tool_call.function.arguments` or
  `input.value` (smolagents writes `Tool.__call__`'s `{"args", "kwargs"}`: the
  kwargs); its result in `output.value` (a ToolMessage's `content`).
- smolagents' own roles: `tool-call` is its rendering of the model's calls
  ("Calling tools:\n[...]", a Python literal), `tool-response` what it showed the
  model of their results ("Call id: ..." when it names the call).
- AGENT / CHAIN: `input.value` and `output.value`, the run's task and answer when no
  model call carried them; `agent.name`, else the outermost AGENT span's name.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from app.formats.otlp.conversation import ROLES, Call, Exchange, Message, ToolRun, text_of
from app.formats.otlp.spans import Span, failure
from app.formats.otlp.unflatten import decoded_json, indexed

KIND = "openinference.span.kind"
# input.value keys that hold the task, for agents that send their inputs as JSON.
_TASK_KEYS = ("task", "input", "query", "question", "prompt", "message")
_CALLING_TOOLS = "Calling tools:"
_CALL_ID = re.compile(r"Call id: *(\S+)")
# A rendering of calls longer than this is not parsed back (literal_eval's cost).
_MAX_RENDERED = 100_000


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
    arguments = decoded_json(a.get("tool_call.function.arguments", a.get("input.value")))
    output = decoded_json(a.get("output.value"))
    message = output.get("data") if isinstance(output, dict) else None
    if not (isinstance(message, dict) and "tool_call_id" in message):
        message = output if isinstance(output, dict) and "tool_call_id" in output else None
    return ToolRun(
        start=span.start,
        name=str(a.get("tool.name") or a.get("tool_call.function.name") or span.name),
        call_id=_str(a.get("tool_call.id")) or _str(message and message.get("tool_call_id")),
        arguments=called_with(arguments),
        result=text_of(message.get("content") if message else a.get("output.value")),
        error=failure(span),
    )


def called_with(arguments: Any) -> Any:
    """A tool's arguments, out of the `{"args": [], "kwargs": {...}}` a Python wrapper
    records for its own signature."""
    if (isinstance(arguments, dict) and isinstance(arguments.get("kwargs"), dict)
            and not arguments.get("args") and set(arguments) <= {"args", "kwargs",
                                                                 "sanitize_inputs_outputs"}):
        return arguments["kwargs"]
    return arguments


def agent_name(spans: list[Span]) -> str | None:
    """The outermost AGENT span's name (smolagents: `<name>.run`)."""
    agents = [s for s in spans if kind(s) == "AGENT"]
    outer = next((s for s in agents if s.root), agents[0] if agents else None)
    if outer is None or not outer.name:
        return None
    return outer.name.removesuffix(".run")


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
    said = str(raw.get("role", "")).lower()
    content = raw.get("content")
    if content is None and isinstance(raw.get("contents"), list):
        texts = [c["message_content"].get("text") for c in raw["contents"]
                 if isinstance(c, dict) and isinstance(c.get("message_content"), dict)]
        content = "\n".join(t for t in texts if isinstance(t, str)) or None
    if said == "tool-call":
        return _rendered_calls(content)
    if said == "tool-response":
        text = text_of(content)
        named = _CALL_ID.match(text or "")
        return [Message("tool", text=text, call_id=named.group(1) if named else None)]
    role = ROLES.get(said)
    if role is None:
        return []
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


def _rendered_calls(content: Any) -> list[Message]:
    """smolagents' "Calling tools:\n[{'id', 'function': {'name', 'arguments'}}]": the
    calls the model made (matched with its own output, never added as said), or, for
    a CodeAgent, the code it wrote as one `python_interpreter` call, which it did not
    make."""
    text = content if isinstance(content, str) else ""
    listing = text.strip().removeprefix(_CALLING_TOOLS).strip()
    if not text.strip().startswith(_CALLING_TOOLS) or len(listing) > _MAX_RENDERED:
        return []
    try:
        listed = ast.literal_eval(listing)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return []
    calls = []
    for item in listed if isinstance(listed, list) else []:
        fn = item.get("function") if isinstance(item, dict) else None
        if isinstance(fn, dict):
            calls.append(Call(str(fn.get("name") or ""), fn.get("arguments"), _str(item.get("id"))))
    return [Message("assistant", calls=calls, rendered=True)] if calls else []


def _str(value: Any) -> str | None:
    return None if value is None or value == "" else str(value)
