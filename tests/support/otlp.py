"""OTLP for tests: spans as OTLP/JSON, written as the specification writes them (hex
ids, 64-bit integers as strings), and as the OpenTelemetry SDK records them; the run
that docs/otlp.md and /work/shared/reference/otel-genai-examples.md show (a user asks
for the weather in Paris, the model calls get_weather, the tool answers, the model
answers); and reading what a hub made of them. tests/support/otlp_agent.py is the same
run by a real agent under a real instrumentation."""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.formats.otlp import wire
from tests.support.databases import db_execute
from tests.support.waiting import wait_until

PROTOBUF = {"Content-Type": "application/x-protobuf"}
# otlp.quiet_seconds short, so that a test waits a second, not ten.
QUIET = {"quiet_seconds": 0.5, "max_wait_seconds": 60}

TASK = "What is the weather in Paris?"
RESULT = "18 degrees, sunny"
ANSWER = "It is 18 degrees and sunny in Paris."
CALL = {"arguments": {"city": "Paris"}, "name": "get_weather", "id": "call_w1",
        "type": "tool_call"}
# gen_ai.input/output.messages, as opentelemetry-instrumentation-openai-v2 writes them.
USER = {"role": "user", "parts": [{"content": TASK, "type": "text"}]}
CALLS = {"role": "assistant", "parts": [CALL]}
TOOL = {"role": "tool", "parts": [{"response": RESULT, "id": "call_w1",
                                   "type": "tool_call_response"}]}
SAYS = {"role": "assistant", "parts": [{"content": ANSWER, "type": "text"}],
        "finish_reason": "stop"}


def trace_id() -> str:
    return os.urandom(16).hex()


def span_id() -> str:
    return os.urandom(8).hex()


def value(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, (list, dict)):
        return {"stringValue": json.dumps(v)}  # as the Python instrumentations send JSON
    return {"stringValue": v}


def attributes(attrs: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": value(v)} for k, v in attrs.items()]


def span(
    trace: str,
    name: str,
    start: int,
    attrs: dict[str, Any] | None = None,
    *,
    sid: str | None = None,
    parent: str | None = None,
    end: int | None = None,
    events: list[dict[str, Any]] | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "traceId": trace,
        "spanId": sid or span_id(),
        "name": name,
        "kind": 1,
        "startTimeUnixNano": str(start),
        "endTimeUnixNano": str(end if end is not None else start + 5),
        "attributes": attributes(attrs or {}),
    }
    if parent:
        out["parentSpanId"] = parent
    if events:
        out["events"] = events
    if error is not None:
        out["status"] = {"code": 2, "message": error}
    return out


def event(name: str, time: int, attrs: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "timeUnixNano": str(time), "attributes": attributes(attrs)}


def document(spans: list[dict[str, Any]], service: str = "weather-agent") -> dict[str, Any]:
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": attributes({"service.name": service})},
                "scopeSpans": [{"scope": {"name": "tests"}, "spans": spans}],
            }
        ]
    }


def chat(trace: str, start: int, inputs: list[Any], outputs: list[Any], *,
         parent: str | None = None, **attrs: Any) -> dict[str, Any]:
    """A chat span as opentelemetry-instrumentation-openai-v2 writes it."""
    return span(trace, "chat gpt-4o-mini", start, {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "gpt-4o-mini",
        "gen_ai.provider.name": "openai",
        "gen_ai.input.messages": inputs,
        "gen_ai.output.messages": outputs,
        **attrs,
    }, parent=parent, end=start + 5)


def weather_run(trace: str, **root_attrs: Any) -> list[dict[str, Any]]:
    """The run as an agent instrumented with the GenAI conventions sends it: an
    invoke_agent root, two chat spans and the tool's execute_tool span."""
    root = span_id()
    return [
        span(trace, "invoke_agent weather", 100, {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "weather",
            **root_attrs}, sid=root, end=200),
        chat(trace, 110, [USER], [CALLS], parent=root),
        span(trace, "execute_tool get_weather", 120, {
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "get_weather",
            "gen_ai.tool.call.id": "call_w1", "gen_ai.tool.call.arguments": {"city": "Paris"},
            "gen_ai.tool.call.result": RESULT}, parent=root),
        chat(trace, 130, [USER, CALLS, TOOL], [SAYS], parent=root),
    ]


def weather_steps(trace: dict[str, Any]) -> list[tuple[Any, ...]]:
    """A stored canonical trace's steps, in the shape the weather run expects."""
    return [
        (s["type"], s.get("tool"), s.get("arguments"), s.get("call_id"), s.get("content"))
        for s in trace["steps"]
    ]


WEATHER_STEPS = [
    ("action", "get_weather", {"city": "Paris"}, "call_w1", None),
    ("observation", None, None, "call_w1", RESULT),
    ("final", None, None, None, ANSWER),
]


def protobuf(doc: dict[str, Any]) -> bytes:
    """An OTLP/JSON document as the protobuf ExportTraceServiceRequest exporters send."""
    request, problems = wire.from_json(doc)
    assert problems == []
    return bytes(request.SerializeToString())


def recorded_run(**root: Any) -> tuple[str, list[ReadableSpan]]:
    """The weather run as the OpenTelemetry SDK records it: an invoke_agent root span,
    two chat spans as the OpenAI instrumentation writes them, the tool's span; and its
    trace id."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "weather-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("weather-agent")

    def chat_attributes(inputs: list[Any], outputs: list[Any]) -> dict[str, Any]:
        return {"gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o-mini",
                "gen_ai.input.messages": json.dumps(inputs),
                "gen_ai.output.messages": json.dumps(outputs)}

    agent = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "weather", **root}
    with tracer.start_as_current_span("invoke_agent weather", attributes=agent) as run:
        with tracer.start_as_current_span("chat gpt-4o-mini",
                                          attributes=chat_attributes([USER], [CALLS])):
            pass
        with tracer.start_as_current_span("execute_tool get_weather", attributes={
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "get_weather",
            "gen_ai.tool.call.id": "call_w1", "gen_ai.tool.call.result": RESULT,
        }):
            pass
        with tracer.start_as_current_span(
            "chat gpt-4o-mini", attributes=chat_attributes([USER, CALLS, TOOL], [SAYS])
        ):
            pass
        tid = format(run.get_span_context().trace_id, "032x")
    provider.shutdown()
    return tid, list(memory.get_finished_spans())


def trajectory(client: httpx.Client, tid: str, **headers: str) -> dict[str, Any]:
    """The trace once the hub has assembled it."""
    def stored() -> dict[str, Any] | None:
        r = client.get(f"/v1/traces/{tid}", headers=headers)
        return r.json() if r.status_code == 200 else None

    record = wait_until(stored, what=f"trajectory {tid}")
    assert record is not None  # wait_until returns a true value
    return record


def staged(trace_server: dict[str, Any], tid: str) -> list[str]:
    """The span ids otlp_spans holds for a trace, read as a user would with sqlite3/psql."""
    rows = db_execute(trace_server, "SELECT span_id FROM otlp_spans WHERE trace_id = :t", t=tid)
    return [row["span_id"] for row in rows]


def otlp_stats(client: httpx.Client) -> dict[str, int]:
    """/v1/stats' OTLP counts (its `refusals`, the reasons, left out)."""
    counts: dict[str, int] = {k: v for k, v in client.get("/v1/stats").json()["otlp"].items()
                              if k != "refusals"}
    return counts


def megabyte(kind: str, hostile: bool) -> dict[str, Any]:
    """About 1 MB of spans where assembly does the most work per byte, and, as the
    yardstick, the same trajectory sent as instrumentations usually send it.

    calls: thousands of model calls, each saying something new (each is merged into
    the conversation so far), or one call saying it all, beside as many spans without
    messages. runs: thousands of tool runs without their call id (each looks for its
    call), or their results in the conversation, beside as many plain spans."""
    t = trace_id()
    if kind == "calls":
        said = [{"role": "user", "parts": [{"type": "text", "content": f"and now {i}?"}]}
                for i in range(3300)]
        # The model answers once, at the end: a trajectory needs an assistant turn.
        if hostile:
            return document([span(t, "chat", 100 + i, {"gen_ai.input.messages": [m]})
                             for i, m in enumerate(said)] + [chat(t, 5000, [], [SAYS])])
        return document([span(t, "chat", 100, {"gen_ai.input.messages": said,
                                               "gen_ai.output.messages": [SAYS]})] + [
            span(t, "chat", 101 + i, {"gen_ai.operation.name": "chat"}) for i in range(3299)])
    calls = [{"type": "tool_call", "name": "s", "id": f"c{i}", "arguments": {"q": i}}
             for i in range(2200)]
    asked = chat(t, 10, [USER], [{"role": "assistant", "parts": calls}])
    if hostile:
        return document([asked] + [span(t, "t", 100 + i, {
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "s",
            "gen_ai.tool.call.arguments": {"q": i}}) for i in range(2200)])
    results = [{"role": "tool", "parts": [{"type": "tool_call_response", "id": f"c{i}",
                                           "response": None}]} for i in range(2200)]
    answered = chat(t, 20, [USER, {"role": "assistant", "parts": calls}, *results], [SAYS])
    return document([asked, answered] + [
        span(t, "t", 100 + i, {"db.system": "s", "db.query.text": f"q={i}"})
        for i in range(2200)])
