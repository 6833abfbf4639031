"""One weather run by a real agent framework, under its own instrumentation, as its
users set it up; run in the frameworks' venv (scripts/framework_venv.sh), not the
project's. The environment says where the model (OPENAI_BASE_URL, OPENAI_API_KEY) and
the spans (OTEL_EXPORTER_OTLP_ENDPOINT) go; nothing here knows the hub.

    python tests/support/framework_agent.py SETUP   # prints the run's trace id

SETUP: openai-agents-oi, openai-agents-logfire, langgraph, smolagents-toolcalling,
smolagents-code, pydantic-ai.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

MODEL = "fake-gpt-4o-mini"
SYSTEM = "You answer weather questions briefly."
TASK = "What is the weather in Paris?"


def get_weather(city: str) -> str:
    """Get the current weather for a city.

    Args:
        city: The city's name.
    """
    return f"18 degrees, sunny in {city}"


class _Roots(SpanProcessor):
    """A span processor that remembers the trace id of each root span the framework
    starts: the run's trace."""

    def __init__(self) -> None:
        self.trace_ids: list[str] = []

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if span.parent is None:
            self.trace_ids.append(format(span.get_span_context().trace_id, "032x"))


ROOTS = _Roots()


def _provider() -> TracerProvider:
    provider = TracerProvider()  # service.name from OTEL_SERVICE_NAME
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    provider.add_span_processor(ROOTS)
    trace.set_tracer_provider(provider)
    return provider


def openai_agents(logfire_too: bool) -> None:
    import agents
    from openai import AsyncOpenAI

    agents.set_trace_processors([])  # no export to OpenAI's own tracing service
    if logfire_too:
        import logfire

        # OTEL_EXPORTER_OTLP_ENDPOINT sends its spans to the hub.
        logfire.configure(send_to_logfire=False, console=False,
                          additional_span_processors=[ROOTS])
        logfire.instrument_openai_agents()
    else:
        from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor

        OpenAIAgentsInstrumentor().instrument(tracer_provider=_provider())
    model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI())
    agent = agents.Agent(name="weather_agent", instructions=SYSTEM, model=model,
                         tools=[agents.function_tool(get_weather)])
    agents.Runner.run_sync(agent, TASK)


def langgraph() -> None:
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent
    from openinference.instrumentation.langchain import LangChainInstrumentor

    LangChainInstrumentor().instrument(tracer_provider=_provider())
    agent = create_react_agent(ChatOpenAI(model=MODEL), tools=[get_weather], prompt=SYSTEM,
                               name="weather_agent")
    agent.invoke({"messages": [{"role": "user", "content": TASK}]})


def smolagents(kind: str) -> None:
    from openinference.instrumentation.smolagents import SmolagentsInstrumentor
    from smolagents import CodeAgent, OpenAIServerModel, ToolCallingAgent, tool

    SmolagentsInstrumentor().instrument(tracer_provider=_provider())
    model = OpenAIServerModel(model_id=MODEL, api_base=os.environ["OPENAI_BASE_URL"],
                              api_key=os.environ["OPENAI_API_KEY"])
    cls = CodeAgent if kind == "code" else ToolCallingAgent
    agent = cls(tools=[tool(get_weather)], model=model, name="weather_agent", max_steps=4)
    agent.run(TASK)


def pydantic_ai() -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel

    _provider()
    Agent.instrument_all()
    agent = Agent(OpenAIChatModel(MODEL), name="weather_agent", system_prompt=SYSTEM)
    agent.tool_plain(get_weather)
    agent.run_sync(TASK)


RUNS: dict[str, Callable[[], None]] = {
    "openai-agents-oi": lambda: openai_agents(logfire_too=False),
    "openai-agents-logfire": lambda: openai_agents(logfire_too=True),
    "langgraph": langgraph,
    "smolagents-toolcalling": lambda: smolagents("toolcalling"),
    "smolagents-code": lambda: smolagents("code"),
    "pydantic-ai": pydantic_ai,
}


def main(setup: str) -> None:
    RUNS[setup]()
    provider = trace.get_tracer_provider()
    for flush in ("force_flush", "shutdown"):  # exports what is left
        getattr(provider, flush, lambda: None)()
    print(ROOTS.trace_ids[0])


if __name__ == "__main__":
    main(sys.argv[1])
