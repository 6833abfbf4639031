"""OTLP/HTTP on /v1/traces, driven by real OpenTelemetry clients against a live hub:
the SDK's OTLP/HTTP exporter (protobuf, gzip, auth), OTLP/JSON bodies, the official
OpenAI instrumentation and OpenInference's around the `openai` client, and a hub killed
between the 200 and the assembly."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any

import httpx
import pytest
from google.rpc import status_pb2
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.formats.otlp import wire
from tests.conftest import ROOT, HubProcess, db_execute, make_api_key
from tests.fakes.model_server import FakeModel
from tests.otlp_spans import (
    ANSWER,
    CALLS,
    RESULT,
    SAYS,
    TASK,
    TOOL,
    USER,
    WEATHER_STEPS,
    document,
    span,
    trace_id,
    weather_run,
    weather_steps,
)
from tests.pipeline import wait_until
from tests.test_admission import write_lock

PROTOBUF = {"Content-Type": "application/x-protobuf"}
# Short, so that a test waits a second, not ten.
QUIET = {"quiet_seconds": 0.5, "max_wait_seconds": 60}


@pytest.fixture
def otlp_hub(start_hub: Any, trace_server: dict[str, Any]) -> HubProcess:
    hub: HubProcess = start_hub(trace_server, otlp=QUIET)
    return hub


def recorded_run(**root: Any) -> tuple[str, list[ReadableSpan]]:
    """The weather run as the OpenTelemetry SDK records it: an invoke_agent root span,
    two chat spans as the OpenAI instrumentation writes them, the tool's span."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "weather-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("weather-agent")

    def chat(inputs: list[Any], outputs: list[Any]) -> dict[str, Any]:
        return {"gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o-mini",
                "gen_ai.input.messages": json.dumps(inputs),
                "gen_ai.output.messages": json.dumps(outputs)}

    agent = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "weather", **root}
    with tracer.start_as_current_span("invoke_agent weather", attributes=agent) as run:
        with tracer.start_as_current_span("chat gpt-4o-mini", attributes=chat([USER], [CALLS])):
            pass
        with tracer.start_as_current_span("execute_tool get_weather", attributes={
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "get_weather",
            "gen_ai.tool.call.id": "call_w1", "gen_ai.tool.call.result": RESULT,
        }):
            pass
        with tracer.start_as_current_span(
            "chat gpt-4o-mini", attributes=chat([USER, CALLS, TOOL], [SAYS])
        ):
            pass
        tid = format(run.get_span_context().trace_id, "032x")
    provider.shutdown()
    return tid, list(memory.get_finished_spans())


@pytest.fixture
def exporter(otlp_hub: HubProcess) -> Iterator[OTLPSpanExporter]:
    exp = OTLPSpanExporter(endpoint=f"{otlp_hub.url}/v1/traces", timeout=10)
    yield exp
    exp.shutdown()


def trajectory(client: httpx.Client, tid: str, **headers: str) -> dict[str, Any]:
    """The trace once the hub has assembled it."""
    def stored() -> dict[str, Any] | None:
        r = client.get(f"/v1/traces/{tid}", headers=headers)
        return r.json() if r.status_code == 200 else None

    record: dict[str, Any] = wait_until(stored, what=f"trajectory {tid}")
    return record


def staged(trace_server: dict[str, Any], tid: str) -> list[str]:
    """The span ids otlp_spans holds for a trace, read as a user would with sqlite3/psql."""
    rows = db_execute(trace_server, "SELECT span_id FROM otlp_spans WHERE trace_id = :t", t=tid)
    return [row["span_id"] for row in rows]


def otlp_stats(client: httpx.Client) -> dict[str, int]:
    counts: dict[str, int] = client.get("/v1/stats").json()["otlp"]
    return counts


# --- the SDK's exporter -----------------------------------------------------------------


def test_the_sdk_exporter_makes_one_trajectory(
    otlp_hub: HubProcess, exporter: OTLPSpanExporter
) -> None:
    tid, spans = recorded_run(**{"atropos.reward": 0.5})
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    with otlp_hub.client() as client:
        record = trajectory(client, tid)
        assert record["trace_id"] == tid and len(tid) == 32
        assert record["env_reward"] == 0.5  # the environment's reward, scored by its rule
        assert record["reward_breakdown"]["env_reward"]["points"] == 10
        assert record["format"] == "otlp"
        assert (record["agent"], record["model"], record["env"]) == (
            "weather", "gpt-4o-mini", "weather-agent")
        assert record["trace"]["task"] == TASK
        assert weather_steps(record["trace"]) == WEATHER_STEPS
        original = client.get(f"/v1/traces/{tid}", params={"view": "original"}).json()["trace"]
        sent = {format(s.context.span_id, "016x") for s in spans}
        stored = [s for rs in original["resourceSpans"] for ss in rs["scopeSpans"]
                  for s in ss["spans"]]
        assert {s["spanId"] for s in stored} == sent
        assert {s["traceId"] for s in stored} == {tid}
        assert otlp_stats(client) == {"open_traces": 0, "assembled_traces": 1,
                                      "refused_traces": 0, "spans": 4, "late_spans": 0}


def test_gzip_and_an_api_key_as_exporters_send_them(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    hub = start_hub(trace_server, otlp=QUIET, auth={"enabled": True})
    key = make_api_key(trace_server, "ingest")
    reader = make_api_key(trace_server, "read")
    endpoint = f"{hub.url}/v1/traces"
    tid, spans = recorded_run()
    without = OTLPSpanExporter(endpoint=endpoint, timeout=5)
    wrong_scope = OTLPSpanExporter(endpoint=endpoint, timeout=5,
                                   headers={"Authorization": f"Bearer {reader}"})
    # OTEL_EXPORTER_OTLP_HEADERS="Authorization=Bearer <key>" sets the same header.
    keyed = OTLPSpanExporter(endpoint=endpoint, timeout=5, compression=Compression.Gzip,
                             headers={"Authorization": f"Bearer {key}"})
    try:
        assert without.export(spans) is SpanExportResult.FAILURE
        assert wrong_scope.export(spans) is SpanExportResult.FAILURE
        assert keyed.export(spans) is SpanExportResult.SUCCESS
    finally:
        for exp in (without, wrong_scope, keyed):
            exp.shutdown()
    body = wire.from_json(document(weather_run(trace_id())))[0].SerializeToString()
    with hub.client() as client:
        refused = client.post("/v1/traces", content=body, headers=PROTOBUF)
        assert refused.status_code == 401
        assert refused.headers["content-type"] == "application/x-protobuf"
        status = status_pb2.Status.FromString(refused.content)
        assert status.code == 16 and "key" in status.message  # UNAUTHENTICATED
        record = trajectory(client, tid, Authorization=f"Bearer {reader}")
        assert weather_steps(record["trace"]) == WEATHER_STEPS


# --- OTLP/JSON ---------------------------------------------------------------------------


def test_otlp_json_with_hex_or_base64_ids(otlp_hub: HubProcess) -> None:
    import base64

    hexed, based = trace_id(), trace_id()
    base64_doc = document(weather_run(based))
    for s in base64_doc["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        for key in ("traceId", "spanId", "parentSpanId"):
            if key in s:
                s[key] = base64.b64encode(bytes.fromhex(s[key])).decode()
    with otlp_hub.client() as client:
        for doc in (document(weather_run(hexed)), base64_doc):
            r = client.post("/v1/traces", json=doc)
            assert r.status_code == 200, r.text
            assert r.headers["content-type"] == "application/json"
            assert r.json() == {}
        for tid in (hexed, based):
            assert weather_steps(trajectory(client, tid)["trace"]) == WEATHER_STEPS


def test_unusable_spans_are_a_partial_success(otlp_hub: HubProcess) -> None:
    tid = trace_id()
    doc = document(weather_run(tid))
    spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans.append(span("not-hex", "stray", 300))
    spans.append(span("00" * 16, "zero", 300))
    with otlp_hub.client() as client:
        r = client.post("/v1/traces", json=doc)
        assert r.status_code == 200
        partial = r.json()["partialSuccess"]
        assert partial["rejectedSpans"] == "2"
        assert "spans[4]: 'not-hex' is neither" in partial["errorMessage"]
        assert "span 'zero': traceId must be 16 bytes" in partial["errorMessage"]
        # The same in protobuf: the answer in the request's encoding.
        request, _ = wire.from_json(document(weather_run(trace_id())))
        request.resource_spans[0].scope_spans[0].spans[1].span_id = b"\0" * 8
        r = client.post("/v1/traces", content=request.SerializeToString(), headers=PROTOBUF)
        assert r.status_code == 200
        answer = ExportTraceServiceResponse.FromString(r.content)
        assert answer.partial_success.rejected_spans == 1
        assert "spanId" in answer.partial_success.error_message
        assert weather_steps(trajectory(client, tid)["trace"]) == WEATHER_STEPS


def test_a_body_that_does_not_decode_is_a_400_in_its_encoding(otlp_hub: HubProcess) -> None:
    with otlp_hub.client() as client:
        r = client.post("/v1/traces", content=b"\xff\xfe not protobuf", headers=PROTOBUF)
        assert r.status_code == 400
        status = status_pb2.Status.FromString(r.content)
        assert status.code == 3 and "ExportTraceServiceRequest" in status.message  # INVALID_ARGUMENT
        r = client.post("/v1/traces", json={"resourceSpans": {"not": "a list"}})
        assert r.status_code == 400
        body = r.json()
        assert body["code"] == 3 and body["error"]["field"] == "resourceSpans"
        gz = gzip.compress(b"\x0a\x03abc")[:-4]  # truncated
        r = client.post("/v1/traces", content=gz,
                        headers={**PROTOBUF, "Content-Encoding": "gzip"})
        assert r.status_code == 400
        assert "gzip" in status_pb2.Status.FromString(r.content).message


# --- assembly ----------------------------------------------------------------------------------


def test_shuffled_spans_over_three_requests_and_a_repeat_make_one_trajectory(
    otlp_hub: HubProcess, exporter: OTLPSpanExporter
) -> None:
    tid, spans = recorded_run()
    random.Random(7).shuffle(spans)
    parts = [spans[:1], spans[1:3], spans[3:]]
    for part in parts + [parts[1]]:  # the last one resent, as an exporter retrying
        assert exporter.export(part) is SpanExportResult.SUCCESS
    with otlp_hub.client() as client:
        record = trajectory(client, tid)
        assert record["trace"]["task"] == TASK
        assert weather_steps(record["trace"]) == WEATHER_STEPS
        assert record["trace"]["metadata"]["spans"] == 4
        assert otlp_stats(client)["spans"] == 4
        assert client.get("/v1/stats").json()["traces"] == 1


def test_a_span_after_assembly_scores_the_trajectory_again(
    otlp_hub: HubProcess, exporter: OTLPSpanExporter
) -> None:
    tid, spans = recorded_run()
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    root = next(s for s in spans if s.parent is None)
    with otlp_hub.client() as client:
        first = trajectory(client, tid)
        verdict = span(tid, "evaluate", 10**18, {"atropos.reward": 1.0,
                                                 "atropos.outcome.status": "success"},
                       parent=format(root.context.span_id, "016x"))
        assert client.post("/v1/traces", json=document([verdict])).status_code == 200
        again = wait_until(
            lambda: (r := client.get(f"/v1/traces/{tid}").json())["trace"]["metadata"]["spans"]
            == 5 and r,
            what="the trajectory assembled again",
        )
        assert again["created_at"] == first["created_at"]
        assert again["status"] == "success" and first["status"] == "unknown"
        assert again["reward"] != first["reward"]
        assert weather_steps(again["trace"]) == WEATHER_STEPS
        assert otlp_stats(client)["late_spans"] == 0


def test_a_span_after_batching_is_kept_and_counted_late(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Any
) -> None:
    hub = start_hub(trace_server, otlp=QUIET, distributor={
        "target": "jsonl", "batch_size": 1, "min_reward_threshold": -100,
        "output_dir": str(tmp_path / "batches")})
    tid = trace_id()
    spans = weather_run(tid)
    with hub.client() as client:
        assert client.post("/v1/traces", json=document(spans)).status_code == 200
        wait_until(lambda: client.get(f"/v1/traces/{tid}").json().get("stage")
                 in ("batched", "delivered"), what="the trajectory batched")
        before = client.get(f"/v1/traces/{tid}").json()
        # The spans it was made of leave the staging table: its original holds them.
        wait_until(lambda: not staged(trace_server, tid), what="the batched spans deleted")
        late = span(tid, "late", 400, {"atropos.reward": 1.0}, parent=spans[0]["spanId"])
        assert client.post("/v1/traces", json=document([late])).status_code == 200
        wait_until(lambda: otlp_stats(client)["late_spans"] == 1, what="the late span counted")
        after = client.get(f"/v1/traces/{tid}").json()
        assert after["trace"] == before["trace"] and after["reward"] == before["reward"]
        assert otlp_stats(client)["spans"] == 5
        assert staged(trace_server, tid) == [late["spanId"]]  # kept


def test_without_a_root_span_it_is_assembled_after_max_wait_as_incomplete(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    hub = start_hub(trace_server, otlp={"quiet_seconds": 0.5, "max_wait_seconds": 2})
    tid = trace_id()
    with hub.client() as client:
        started = time.monotonic()
        assert client.post("/v1/traces", json=document(weather_run(tid)[1:])).status_code == 200
        record = trajectory(client, tid)
        assert time.monotonic() - started >= 2
        assert record["trace"]["metadata"]["incomplete"] is True
        assert weather_steps(record["trace"]) == WEATHER_STEPS


def test_spans_without_agent_content_are_refused_and_said_why(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    hub = start_hub(trace_server, otlp={"quiet_seconds": 0.5, "max_wait_seconds": 8})
    tid = trace_id()
    plain = document([span(tid, "GET /", 100, {"http.request.method": "GET"})])
    with hub.client() as client:
        assert client.post("/v1/traces", json=plain).status_code == 200
        posted = time.monotonic()
        wait_until(lambda: otlp_stats(client)["refused_traces"] == 1, what="the trace refused")
        assert client.get(f"/v1/traces/{tid}").status_code == 404
        hub.wait_for_log(f"OTLP trace {tid} makes no trajectory")
        # Kept for otlp.max_wait_seconds after its last span (more might make it one).
        spans_now = staged(trace_server, tid)
        if time.monotonic() - posted < 7:
            assert spans_now
        wait_until(lambda: not staged(trace_server, tid), what="the refused spans dropped")
        assert otlp_stats(client)["refused_traces"] == 1


def test_kill_9_after_the_200_and_before_assembly(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    hub = start_hub(trace_server, otlp={"quiet_seconds": 60})
    tid = trace_id()
    spans = weather_run(tid)
    with hub.client() as client:
        for part in (spans[:2], spans[2:]):
            assert client.post("/v1/traces", json=document(part)).status_code == 200
        assert otlp_stats(client)["open_traces"] == 1
    hub.kill()
    restarted = start_hub(trace_server, otlp=QUIET)
    with restarted.client() as client:
        record = trajectory(client, tid)
        assert record["trace"]["metadata"]["spans"] == 4
        assert weather_steps(record["trace"]) == WEATHER_STEPS


# --- back-pressure -------------------------------------------------------------------------


def test_overload_is_a_503_with_retry_after_in_the_requests_encoding(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    """Two requests of 4 spans while the database is locked, with room for 4: the first
    admitted waits for the lock, the other is turned away at once."""
    hub = start_hub(trace_server, "--no-workers", otlp=QUIET, limits={
        "max_queued_traces": 4, "max_traces_per_request": 4, "max_write_wait_seconds": 60,
        "retry_after_seconds": 3})

    def post_protobuf() -> httpx.Response:
        request, _ = wire.from_json(document(weather_run(trace_id())))
        with hub.client() as c:
            return c.post("/v1/traces", content=request.SerializeToString(), headers=PROTOBUF)

    with hub.client() as client, ThreadPoolExecutor(2) as pool:
        assert client.post("/v1/traces", json=document(weather_run(trace_id())[:1])).status_code == 200
        with write_lock(trace_server, "otlp_spans"):
            posts = [pool.submit(post_protobuf) for _ in range(2)]
            done, waiting = wait(posts, timeout=30, return_when=FIRST_COMPLETED)
            (refused,) = [f.result() for f in done]
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "3"
            status = status_pb2.Status.FromString(refused.content)
            assert status.code == 14 and "limits.max_queued_traces" in status.message
            r = client.post("/v1/traces", json=document(weather_run(trace_id())[:1]))
            assert r.status_code == 503 and r.json()["code"] == 14
            assert r.json()["error"]["field"] == "limits.max_queued_traces"
            assert len(waiting) == 1
        assert waiting.pop().result(30).status_code == 200
        assert otlp_stats(client)["spans"] == 5


# --- real instrumentations ------------------------------------------------------------------------


def _weather_model(body: dict[str, Any]) -> str | dict[str, Any]:
    """A model that calls get_weather, then answers from its result."""
    if body["messages"][-1]["role"] == "tool":
        return ANSWER
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_w1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


@pytest.mark.parametrize("instrumentation", ["openai-v2", "openinference"])
def test_an_instrumented_openai_agent_feeds_the_hub_by_environment_alone(
    otlp_hub: HubProcess, fake_model: FakeModel, model_root: str, instrumentation: str
) -> None:
    fake_model.reply = _weather_model
    env = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_hub.url,  # the SDK appends /v1/traces
        "OTEL_SERVICE_NAME": "weather-agent",
        "OTEL_SEMCONV_STABILITY_OPT_IN": "gen_ai_latest_experimental",
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "SPAN_AND_EVENT",
        "OPENAI_BASE_URL": f"{model_root}/v1",
        "OPENAI_API_KEY": fake_model.key,
    }
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "otlp_agent.py"),
                           instrumentation], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    tid = done.stdout.strip()
    assert len(fake_model.received) == 2
    with otlp_hub.client() as client:
        record = trajectory(client, tid)
    trace = record["trace"]
    assert trace["task"] == TASK
    assert weather_steps(trace) == WEATHER_STEPS
    assert (record["agent"], record["model"], record["env"]) == (
        "weather", "gpt-4o-mini", "weather-agent")
    if instrumentation == "openinference":  # it records the tools offered (llm.tools)
        assert trace["tools"] == ["get_weather"]


def test_concurrent_exporters(otlp_hub: HubProcess) -> None:
    """Eight exporters at once, each its own runs: every run one trajectory."""
    def send(n: int) -> list[str]:
        exp = OTLPSpanExporter(endpoint=f"{otlp_hub.url}/v1/traces", timeout=30)
        try:
            ids = []
            for _ in range(3):
                tid, spans = recorded_run()
                assert exp.export(spans) is SpanExportResult.SUCCESS
                ids.append(tid)
            return ids
        finally:
            exp.shutdown()

    with ThreadPoolExecutor(8) as pool:
        ids = [tid for ids in pool.map(send, range(8)) for tid in ids]
    with otlp_hub.client() as client:
        for tid in ids:
            assert weather_steps(trajectory(client, tid)["trace"]) == WEATHER_STEPS
        assert otlp_stats(client)["assembled_traces"] == 24
