"""The otlp format: one trace's spans (OTLP/JSON) read as one trajectory, for every
convention docs/otlp.md documents, and the OTLP encodings (app/formats/otlp/wire.py)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from app import formats
from app.domain import Status, StepType
from app.errors import Invalid
from app.formats.otlp import wire
from tests.support.otlp import (
    ANSWER,
    CALLS,
    RESULT,
    SAYS,
    TASK,
    TOOL,
    USER,
    WEATHER_STEPS,
    chat,
    document,
    event,
    span,
    span_id,
    trace_id,
    weather_run,
    weather_steps,
)


def parsed(spans: list[dict[str, Any]], service: str = "weather-agent") -> dict[str, Any]:
    trace = formats.parse(document(spans, service))
    assert trace.source_format == "otlp"
    return trace.model_dump(mode="json", exclude_none=True)


# --- GenAI semantic conventions -------------------------------------------------------


def test_the_openai_v2_chat_spans_make_one_conversation_each_message_once() -> None:
    """The reference capture: two chat spans (no agent or tool span), the second
    repeating the first's messages; one of them the root."""
    t = trace_id()
    first = chat(t, 110, [USER], [CALLS])
    second = chat(t, 130, [USER, CALLS, TOOL], [SAYS], parent=first["spanId"])
    trace = parsed([second, first])
    assert trace["trace_id"] == t
    assert trace["task"] == TASK
    assert weather_steps(trace) == WEATHER_STEPS
    assert trace["agent"] == {"model": "gpt-4o-mini"}
    assert trace["env"] == "weather-agent"
    assert trace["metadata"]["spans"] == 2
    assert "incomplete" not in trace["metadata"]


def test_agent_tool_and_chat_spans_with_system_instructions() -> None:
    t = trace_id()
    spans = weather_run(t, **{"gen_ai.conversation.id": "conv-7"})
    for s in spans[1:4:2]:  # both chat spans carry the instructions
        s["attributes"].append({"key": "gen_ai.system_instructions", "value": {
            "stringValue": json.dumps([{"type": "text", "content": "Answer briefly."}])}})
    trace = parsed(spans)
    assert trace["steps"][0] == {"type": "message", "role": "system",
                                 "content": "Answer briefly."}
    assert weather_steps(trace)[1:] == WEATHER_STEPS
    assert trace["agent"] == {"name": "weather", "model": "gpt-4o-mini"}
    assert trace["tools"] == ["get_weather"]
    assert trace["metadata"]["conversation_id"] == "conv-7"


def test_tool_runs_no_model_call_asked_for_are_placed_in_time() -> None:
    """An agent that records its own tool runs and its input/output on invoke_agent,
    without message content on the model calls."""
    t = trace_id()
    root = span_id()
    tool = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search"}
    trace = parsed([
        span(t, "invoke_agent", 100, {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.input.messages": [USER], "gen_ai.output.messages": [SAYS]},
            sid=root, end=300),
        span(t, "execute_tool search", 150, {**tool, "gen_ai.tool.call.arguments": {"q": "b"},
                                              "gen_ai.tool.call.result": "second"}, parent=root),
        span(t, "execute_tool search", 120, {**tool, "gen_ai.tool.call.arguments": {"q": "a"},
                                              "gen_ai.tool.call.result": "first"}, parent=root),
        span(t, "execute_tool search", 180, tool, parent=root, error="timed out"),
    ])
    assert trace["task"] == TASK
    assert [(s["type"], s.get("arguments"), s.get("content"), s.get("error"))
            for s in trace["steps"]] == [
        ("action", {"q": "a"}, None, None),
        ("observation", None, "first", None),
        ("action", {"q": "b"}, None, None),
        ("observation", None, "second", None),
        ("action", None, None, None),
        ("observation", None, "Error: timed out", "timed out"),
        ("final", None, ANSWER, None),
    ]


def test_a_failed_tool_run_marks_the_result_the_model_saw() -> None:
    t = trace_id()
    spans = weather_run(t)
    spans[2]["status"] = {"code": 2, "message": "upstream 500"}
    trace = parsed(spans)
    observation = trace["steps"][1]
    assert observation["error"] == "upstream 500"
    assert observation["content"] == RESULT  # what the model saw, unchanged


def test_older_genai_events_one_per_message() -> None:
    t = trace_id()
    calls = json.dumps([{"id": "call_w1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}])
    first = span(t, "chat gpt-4o-mini", 100, {"gen_ai.operation.name": "chat"}, events=[
        event("gen_ai.user.message", 100, {"content": TASK}),
        event("gen_ai.choice", 104, {"index": 0, "finish_reason": "tool_calls",
                                     "message": json.dumps({"tool_calls": json.loads(calls)})}),
    ])
    second = span(t, "chat gpt-4o-mini", 120, {"gen_ai.operation.name": "chat"},
                  parent=first["spanId"], events=[
        event("gen_ai.user.message", 120, {"content": TASK}),
        event("gen_ai.assistant.message", 120, {"tool_calls": calls}),
        event("gen_ai.tool.message", 120, {"content": RESULT, "id": "call_w1"}),
        event("gen_ai.choice", 124, {"index": 0, "message": {"content": ANSWER}}),
    ])
    trace = parsed([first, second])
    assert trace["task"] == TASK
    assert weather_steps(trace) == WEATHER_STEPS


def test_openllmetry_indexed_attributes() -> None:
    t = trace_id()

    def prompt(i: int, role: str, **fields: Any) -> dict[str, Any]:
        return {f"gen_ai.prompt.{i}.role": role,
                **{f"gen_ai.prompt.{i}.{k}": v for k, v in fields.items()}}

    call = {"tool_calls.0.id": "call_w1", "tool_calls.0.name": "get_weather",
            "tool_calls.0.arguments": '{"city": "Paris"}'}
    first = span(t, "openai.chat", 100, {
        "llm.request.type": "chat", "gen_ai.system": "OpenAI", "gen_ai.request.model": "gpt-4o",
        **prompt(0, "user", content=TASK),
        "gen_ai.completion.0.role": "assistant",
        **{f"gen_ai.completion.0.{k}": v for k, v in call.items()},
        "llm.request.functions.0.name": "get_weather",
        "llm.request.functions.0.parameters": json.dumps({"type": "object"}),
    })
    second = span(t, "openai.chat", 120, {
        "llm.request.type": "chat", "gen_ai.request.model": "gpt-4o",
        **prompt(0, "user", content=TASK), **prompt(1, "assistant", **call),
        **prompt(2, "tool", content=RESULT, tool_call_id="call_w1"),
        "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": ANSWER,
    }, parent=first["spanId"])
    trace = parsed([first, second])
    assert trace["task"] == TASK
    assert weather_steps(trace) == WEATHER_STEPS
    assert trace["agent"]["model"] == "gpt-4o"
    assert trace["metadata"]["tool_schemas"][0]["function"]["name"] == "get_weather"


# --- OpenInference --------------------------------------------------------------------


def _oi_llm(t: str, start: int, messages: list[dict[str, Any]], output: dict[str, Any],
            parent: str | None) -> dict[str, Any]:
    attrs: dict[str, Any] = {"openinference.span.kind": "LLM", "llm.model_name": "gpt-4o-mini",
                             "llm.tools.0.tool.json_schema": json.dumps({
                                 "type": "function", "function": {"name": "get_weather"}})}
    for prefix, listed in (("llm.input_messages", messages), ("llm.output_messages", [output])):
        for i, message in enumerate(listed):
            for key, v in message.items():
                attrs[f"{prefix}.{i}.message.{key}"] = v
    return span(t, "ChatCompletion", start, attrs, parent=parent)


def test_openinference_llm_tool_and_agent_spans() -> None:
    """The reference capture's attributes, under an AGENT span with a TOOL span."""
    t = trace_id()
    root = span_id()
    call = {"role": "assistant", "tool_calls.0.tool_call.id": "call_w1",
            "tool_calls.0.tool_call.function.name": "get_weather",
            "tool_calls.0.tool_call.function.arguments": '{"city": "Paris"}'}
    user = {"role": "user", "content": TASK}
    tool = {"role": "tool", "tool_call_id": "call_w1", "content": RESULT}
    trace = parsed([
        span(t, "agent", 100, {"openinference.span.kind": "AGENT", "agent.name": "weather",
                               "input.value": json.dumps({"task": TASK}),
                               "output.value": ANSWER, "session.id": "s-1"},
             sid=root, end=300),
        _oi_llm(t, 110, [user], call, root),
        span(t, "get_weather", 120, {"openinference.span.kind": "TOOL", "tool.name": "get_weather",
                                     "input.value": '{"city": "Paris"}', "output.value": RESULT},
             parent=root),
        _oi_llm(t, 130, [user, call, tool], {"role": "assistant", "content": ANSWER}, root),
    ])
    assert trace["task"] == TASK
    assert weather_steps(trace) == WEATHER_STEPS
    assert trace["agent"] == {"name": "weather", "model": "gpt-4o-mini"}
    assert trace["metadata"]["conversation_id"] == "s-1"
    assert trace["metadata"]["tool_schemas"] == [
        {"type": "function", "function": {"name": "get_weather"}}]


def test_openinference_agent_span_alone_gives_task_and_answer() -> None:
    """A framework whose model calls carry no messages: the AGENT span's input and
    output, and its TOOL spans, still make a trajectory."""
    t = trace_id()
    root = span_id()
    trace = parsed([
        span(t, "agent", 100, {"openinference.span.kind": "AGENT", "input.value": TASK,
                               "output.value": ANSWER}, sid=root, end=300),
        span(t, "get_weather", 120, {"openinference.span.kind": "TOOL", "tool.name": "get_weather",
                                     "tool_call.id": "t1", "input.value": '{"city": "Paris"}',
                                     "output.value": RESULT}, parent=root),
    ])
    assert trace["task"] == TASK
    assert weather_steps(trace) == [
        ("action", "get_weather", {"city": "Paris"}, "t1", None),
        ("observation", None, None, "t1", RESULT),
        ("final", None, None, None, ANSWER),
    ]


# --- one conversation -------------------------------------------------------------------


def test_a_message_said_twice_stays_twice() -> None:
    t = trace_id()
    again = {"role": "user", "parts": [{"type": "text", "content": "again"}]}
    ok = {"role": "assistant", "parts": [{"type": "text", "content": "ok"}]}
    trace = parsed([
        chat(t, 100, [USER], [ok]),
        chat(t, 110, [USER, ok, again], [ok]),
        chat(t, 120, [USER, ok, again, ok, again], [SAYS]),
    ])
    assert [(s["type"], s.get("role"), s["content"]) for s in trace["steps"]] == [
        ("message", "assistant", "ok"), ("message", "user", "again"),
        ("message", "assistant", "ok"), ("message", "user", "again"), ("final", None, ANSWER)]


# --- outcome and reward ------------------------------------------------------------------


def _evaluation(time: int, score: float, name: str = "correctness") -> dict[str, Any]:
    return event("gen_ai.evaluation.result", time, {
        "gen_ai.evaluation.name": name, "gen_ai.evaluation.score.value": score,
        "gen_ai.evaluation.score.label": "pass" if score > 0 else "fail"})


def env_reward(trace: Any) -> Any:
    """The environment's reward where the trace carries it: outcome.reward once the
    env_reward column has landed, metadata["reward"] before."""
    outcome_reward = getattr(trace.outcome, "reward", None)
    return outcome_reward if outcome_reward is not None else trace.metadata.get("reward")


def test_the_evaluation_on_the_root_span_is_the_reward() -> None:
    t = trace_id()
    spans = weather_run(t)
    spans[0]["events"] = [_evaluation(190, 0.75)]
    spans[3]["events"] = [_evaluation(140, 0.25, "tone")]
    trace = formats.parse(document(spans))
    assert env_reward(trace) == 0.75
    assert [e["name"] for e in trace.metadata["evaluations"]] == ["correctness", "tone"]


def test_a_root_span_with_status_error_is_a_failure() -> None:
    t = trace_id()
    spans = weather_run(t)
    spans[0]["status"] = {"code": 2, "message": "max iterations reached"}
    trace = formats.parse(document(spans))
    assert trace.outcome.status is Status.FAILURE
    assert trace.outcome.reason == "max iterations reached"


def test_atropos_attributes_state_outcome_and_reward() -> None:
    t = trace_id()
    spans = weather_run(t)
    spans[0]["status"] = {"code": 2}
    spans[0]["events"] = [_evaluation(190, 0.1)]
    spans[3]["attributes"] += [{"key": "atropos.reward", "value": {"doubleValue": 1.0}},
                               {"key": "atropos.outcome.status", "value": {"stringValue": "success"}}]
    trace = formats.parse(document(spans))
    assert trace.outcome.status is Status.SUCCESS
    assert env_reward(trace) == 1.0


def test_a_bad_explicit_status_is_refused_naming_the_attribute() -> None:
    spans = weather_run(trace_id(), **{"atropos.outcome.status": "great"})
    with pytest.raises(Invalid) as refused:
        formats.parse(document(spans))
    assert refused.value.field == "atropos.outcome.status"


def test_without_its_root_span_the_trajectory_is_incomplete() -> None:
    t = trace_id()
    trace = parsed(weather_run(t)[1:])
    assert trace["metadata"]["incomplete"] is True
    assert weather_steps(trace) == WEATHER_STEPS


# --- what is not a trajectory -------------------------------------------------------------


def test_spans_without_messages_say_how_to_capture_them() -> None:
    t = trace_id()
    with pytest.raises(Invalid) as refused:
        formats.parse(document([span(t, "chat gpt-4o", 100, {"gen_ai.operation.name": "chat"})]))
    assert "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_AND_EVENT" in (
        refused.value.message)


def test_one_trajectory_is_one_trace() -> None:
    spans = weather_run(trace_id()) + weather_run(trace_id())
    with pytest.raises(Invalid, match="2 traces"):
        formats.parse(document(spans))


def test_a_bare_clients_calls_read_as_one_run_only_when_each_continues_the_last() -> None:
    """Each call its own trace, no agent span: the second call's messages begin with the
    first's and its answer, so the two are one run, under the first call's trace."""
    first, second = trace_id(), trace_id()
    calls = [chat(first, 100, [USER], [CALLS]), chat(second, 200, [USER, CALLS, TOOL], [SAYS])]
    trace = parsed(calls)
    assert trace["trace_id"] == first
    assert trace["task"] == TASK and trace["steps"][-1] == {"type": "final", "content": ANSWER}
    assert [s["type"] for s in trace["steps"]] == ["action", "observation", "final"]
    # A call that does not continue the conversation is another run.
    other = {"role": "user", "parts": [{"content": "And in Rome?", "type": "text"}]}
    with pytest.raises(Invalid, match="2 traces"):
        formats.parse(document([calls[0], chat(second, 200, [other], [SAYS])]))


def test_a_bad_span_id_is_named_by_its_path() -> None:
    spans = weather_run(trace_id())
    spans[2]["spanId"] = "xyz"
    with pytest.raises(Invalid) as refused:
        formats.parse(document(spans))
    assert refused.value.field == "resourceSpans[0].scopeSpans[0].spans[2].spanId"


# --- the encodings ----------------------------------------------------------------------------


def _b64(hex_id: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_id)).decode()


def test_json_ids_in_hex_or_base64_read_the_same() -> None:
    doc = document(weather_run(trace_id()))
    hexed, problems = wire.from_json(doc)
    assert problems == []
    for s in doc["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        for key in ("traceId", "spanId", "parentSpanId"):
            if key in s:
                s[key] = _b64(s[key])
    based, problems = wire.from_json(doc)
    assert problems == []
    assert based == hexed


def test_a_span_that_cannot_be_read_is_left_out_and_said_why() -> None:
    doc = document(weather_run(trace_id()))
    spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans[1]["traceId"] = "not-an-id"
    spans[2]["spanId"] = "00" * 8
    request, problems = wire.from_json(doc)
    assert problems == ["resourceSpans[0].scopeSpans[0].spans[1]: 'not-an-id' is neither "
                        "32 hex digits nor base64 of 16 bytes"]
    records, rejected = wire.pieces(request)
    assert len(records) == 2
    assert rejected.count == 1
    assert "spanId must be 8 bytes, not all zero" in rejected.reasons[0]


def test_stored_spans_join_back_into_the_request() -> None:
    """The receiver's records, joined by the assembly stage and decoded in an ingest
    process, are the OTLP/JSON the request said (ids in hex)."""
    doc = document(weather_run(trace_id()))
    request, _ = wire.from_json(doc)
    body = request.SerializeToString()
    records, _ = wire.pieces(wire.from_protobuf(body))
    assert [r.root for r in records] == [True, False, False, False]
    joined = wire.join([(r.resource, r.scope, [r.span]) for r in records])
    again = ExportTraceServiceRequest()
    again.ParseFromString(joined)
    assert len(again.resource_spans) == 1  # one resource, its spans regrouped under it
    back = formats.load(joined, "otlp")
    spans = [s for ss in back["resourceSpans"][0]["scopeSpans"] for s in ss["spans"]]
    sent = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert [(s["traceId"], s["spanId"], s.get("parentSpanId")) for s in spans] == [
        (s["traceId"], s["spanId"], s.get("parentSpanId")) for s in sent]
    assert formats.parse(back).steps[-1].type is StepType.FINAL
