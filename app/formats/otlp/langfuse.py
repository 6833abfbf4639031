"""Langfuse's Python SDK (v3), its OTLP exporter pointed at the hub: every span says
what it is in `langfuse.observation.type` (generation, tool, agent, span, ...).

- generation: `langfuse.observation.input` = the request (`{"messages", "tools"}`, or
  the messages alone), `.output` = the answer (an OpenAI message), `.model.name`,
  `.usage_details` (`prompt_tokens` / `completion_tokens`, or `input` / `output`).
- tool: `.input` (a decorated function's `{"args", "kwargs"}`), `.output`; a failure
  is `langfuse.observation.level` ERROR with `.status_message`.
- agent: the span's name is the agent's.
"""

from __future__ import annotations

from typing import Any

from app.formats.otlp import genai
from app.formats.otlp.conversation import Exchange, ToolRun, text_of
from app.formats.otlp.openinference import called_with
from app.formats.otlp.spans import Span, failure
from app.formats.otlp.unflatten import decoded_json

_PREFIX = "langfuse.observation."
TYPE = _PREFIX + "type"
MODEL = _PREFIX + "model.name"


def kind(span: Span) -> str | None:
    value = span.attrs.get(TYPE)
    return value.lower() if isinstance(value, str) else None


def exchange(span: Span) -> Exchange | None:
    if kind(span) != "generation":
        return None
    asked = decoded_json(span.attrs.get(_PREFIX + "input"))
    messages = asked.get("messages") if isinstance(asked, dict) else asked
    answer = decoded_json(span.attrs.get(_PREFIX + "output"))
    inputs = genai.chat_messages(messages)
    outputs = genai.chat_messages([{"role": "assistant", **answer}]
                                    if isinstance(answer, dict) else [])
    if isinstance(answer, str):
        outputs = genai.chat_messages([{"role": "assistant", "content": answer}])
    if not inputs and not outputs:
        return None
    return Exchange(span.start, span.end, inputs, outputs[:1])


def tool_run(span: Span) -> ToolRun | None:
    if kind(span) != "tool":
        return None
    a = span.attrs
    failed = str(a.get(_PREFIX + "level", "")).upper() == "ERROR"
    error = (text_of(a.get(_PREFIX + "status_message")) or failure(span) or "the tool failed"
             if failed or span.failed else None)
    return ToolRun(
        start=span.start,
        name=span.name,
        call_id=None,
        arguments=called_with(decoded_json(a.get(_PREFIX + "input"))),
        result=text_of(decoded_json(a.get(_PREFIX + "output"))),
        error=error,
    )


def tools(span: Span) -> list[Any]:
    asked = decoded_json(span.attrs.get(_PREFIX + "input")) if kind(span) == "generation" else None
    offered = asked.get("tools") if isinstance(asked, dict) else None
    return [t for t in offered if isinstance(t, dict)] if isinstance(offered, list) else []


def agent_name(spans: list[Span]) -> str | None:
    agents = [s for s in spans if kind(s) == "agent"]
    outer = next((s for s in agents if s.root), agents[0] if agents else None)
    return outer.name if outer is not None and outer.name else None


def usage(span: Span) -> tuple[int, int] | None:
    """(input, output) tokens of a generation."""
    if kind(span) != "generation":
        return None
    details = decoded_json(span.attrs.get(_PREFIX + "usage_details"))
    if not isinstance(details, dict):
        return None
    given = details.get("prompt_tokens", details.get("input"))
    taken = details.get("completion_tokens", details.get("output"))
    return (given if isinstance(given, int) else 0, taken if isinstance(taken, int) else 0)
