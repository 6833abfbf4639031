"""A small weather agent, instrumented as its users instrument one, in a process of its
own: the `openai` client under the official OpenAI instrumentation
(opentelemetry-instrumentation-openai-v2) or OpenInference's
(openinference-instrumentation-openai), exporting with the OTLP/HTTP exporter to
OTEL_EXPORTER_OTLP_ENDPOINT. Nothing hub-specific: the environment says where spans
and model calls go (OTEL_*, OPENAI_BASE_URL, OPENAI_API_KEY).

It asks the model for the weather in Paris, runs the get_weather tool the model calls,
asks again, and prints the run's trace id (32 hex digits).

    python tests/support/otlp_agent.py openai-v2 | openinference
"""

from __future__ import annotations

import json
import sys
from typing import Any

from openai import OpenAI
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

TASK = "What is the weather in Paris?"
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def get_weather(city: str) -> str:
    return "18 degrees, sunny" if city == "Paris" else "unknown"


def main(instrumentation: str) -> None:
    provider = TracerProvider()  # service.name from OTEL_SERVICE_NAME
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    if instrumentation == "openai-v2":
        from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor

        OpenAIInstrumentor().instrument()  # type: ignore[no-untyped-call]
        root = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "weather"}
    else:
        from openinference.instrumentation.openai import OpenAIInstrumentor as OIInstrumentor

        OIInstrumentor().instrument()
        root = {"openinference.span.kind": "AGENT", "agent.name": "weather", "input.value": TASK}
    client = OpenAI()
    tracer = trace.get_tracer("weather-agent")
    # Neither instrumentation records the agent's run or its tool calls: the agent does.
    with tracer.start_as_current_span("weather agent", attributes=root) as run:
        messages: list[Any] = [{"role": "user", "content": TASK}]
        while True:
            reply = client.chat.completions.create(
                model="gpt-4o-mini", messages=messages, tools=TOOLS
            ).choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                if instrumentation != "openai-v2":
                    run.set_attribute("output.value", reply.content or "")
                break
            for call in reply.tool_calls:
                assert call.type == "function"
                result = get_weather(**json.loads(call.function.arguments))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        trace_id = format(run.get_span_context().trace_id, "032x")
    provider.shutdown()  # exports what is left
    print(trace_id)


if __name__ == "__main__":
    main(sys.argv[1])
