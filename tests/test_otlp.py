"""OTLP/HTTP on /v1/traces. Real OpenTelemetry clients against `atropos serve`
processes, where they need a socket (the SDK's OTLP/HTTP exporter: protobuf, gzip,
auth; the official OpenAI instrumentation and OpenInference's around the `openai`
client; a hub killed between the 200 and the assembly); OTLP/JSON and protobuf bodies
posted to in-process hubs for the rest: partial success, errors in the request's
encoding, assembly, late spans, limits, back-pressure and secrets."""

from __future__ import annotations

import base64
import gzip
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import pytest
from google.rpc import status_pb2
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, Span
from opentelemetry.sdk.trace.export import SpanExportResult

from app.formats.otlp import wire
from tests.support import ROOT
from tests.support.databases import db_execute, make_api_key, write_lock
from tests.support.fakes.model_server import FakeModel
from tests.support.hubs import InProcessHub
from tests.support.metrics import scrape, value
from tests.support.otlp import (
    ANSWER,
    CALLS,
    PROTOBUF,
    QUIET,
    SAYS,
    TASK,
    TOOL,
    USER,
    WEATHER_STEPS,
    attributes,
    chat,
    document,
    event,
    megabyte,
    otlp_stats,
    protobuf,
    recorded_run,
    span,
    staged,
    trace_id,
    trajectory,
    weather_run,
    weather_steps,
)
from tests.support.processes import HubProcess
from tests.support.waiting import wait_until

# A hub's first spans may wait for its ingest processes to start (up to
# limits.max_write_wait_seconds, then the serving process reads them): exporters that
# send them get the timeout of the tests' other clients.
EXPORT_TIMEOUT = 30


@pytest.fixture
def otlp_hub(start_hub: Any, trace_server: dict[str, Any]) -> InProcessHub:
    hub: InProcessHub = start_hub(trace_server, otlp=QUIET)
    return hub


@pytest.fixture
def otlp_process(start_hub_process: Any, trace_server: dict[str, Any]) -> HubProcess:
    """`atropos serve` listening on 127.0.0.1: for exporters and agents, which need a
    socket."""
    hub: HubProcess = start_hub_process(trace_server, otlp=QUIET)
    return hub


@pytest.fixture
def exporter(otlp_process: HubProcess) -> Iterator[OTLPSpanExporter]:
    exp = OTLPSpanExporter(endpoint=f"{otlp_process.url}/v1/traces", timeout=EXPORT_TIMEOUT)
    yield exp
    exp.shutdown()  # type: ignore[no-untyped-call]


# --- the SDK's exporter, over a socket ------------------------------------------------


@pytest.mark.process
@pytest.mark.framework
def test_the_sdk_exporter_makes_one_trajectory(
    otlp_process: HubProcess, exporter: OTLPSpanExporter
) -> None:
    tid, spans = recorded_run(**{"atropos.reward": 0.5})
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    with otlp_process.client() as client:
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


@pytest.mark.process
@pytest.mark.framework
def test_gzip_and_an_api_key_as_exporters_send_them(
    start_hub_process: Any, trace_server: dict[str, Any]
) -> None:
    hub = start_hub_process(trace_server, otlp=QUIET, auth={"enabled": True})
    key = make_api_key(trace_server, "ingest")
    reader = make_api_key(trace_server, "read")
    endpoint = f"{hub.url}/v1/traces"
    tid, spans = recorded_run()
    without = OTLPSpanExporter(endpoint=endpoint, timeout=5)
    wrong_scope = OTLPSpanExporter(endpoint=endpoint, timeout=5,
                                   headers={"Authorization": f"Bearer {reader}"})
    # OTEL_EXPORTER_OTLP_HEADERS="Authorization=Bearer <key>" sets the same header.
    keyed = OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT, compression=Compression.Gzip,
                             headers={"Authorization": f"Bearer {key}"})
    try:
        assert without.export(spans) is SpanExportResult.FAILURE
        assert wrong_scope.export(spans) is SpanExportResult.FAILURE
        assert keyed.export(spans) is SpanExportResult.SUCCESS
    finally:
        for exp in (without, wrong_scope, keyed):
            exp.shutdown()  # type: ignore[no-untyped-call]
    with hub.client() as client:
        refused = client.post("/v1/traces", content=protobuf(document(weather_run(trace_id()))),
                              headers=PROTOBUF)
        assert refused.status_code == 401
        assert refused.headers["content-type"] == "application/x-protobuf"
        status = status_pb2.Status.FromString(refused.content)
        assert status.code == 16 and "key" in status.message  # UNAUTHENTICATED
        record = trajectory(client, tid, Authorization=f"Bearer {reader}")
        assert weather_steps(record["trace"]) == WEATHER_STEPS


@pytest.mark.process
@pytest.mark.framework
def test_shuffled_spans_over_three_requests_and_a_repeat_make_one_trajectory(
    otlp_process: HubProcess, exporter: OTLPSpanExporter
) -> None:
    tid, spans = recorded_run()
    random.Random(7).shuffle(spans)
    parts = [spans[:1], spans[1:3], spans[3:]]
    for part in parts + [parts[1]]:  # the last one resent, as an exporter retrying
        assert exporter.export(part) is SpanExportResult.SUCCESS
    with otlp_process.client() as client:
        record = trajectory(client, tid)
        assert record["trace"]["task"] == TASK
        assert weather_steps(record["trace"]) == WEATHER_STEPS
        assert record["trace"]["metadata"]["spans"] == 4
        assert otlp_stats(client)["spans"] == 4
        assert client.get("/v1/stats").json()["traces"] == 1


@pytest.mark.process
@pytest.mark.framework
def test_concurrent_exporters(otlp_process: HubProcess) -> None:
    """Eight exporters at once, each its own runs: every run one trajectory."""
    def send(n: int) -> list[str]:
        exp = OTLPSpanExporter(endpoint=f"{otlp_process.url}/v1/traces", timeout=30)
        try:
            ids = []
            for _ in range(3):
                tid, spans = recorded_run()
                assert exp.export(spans) is SpanExportResult.SUCCESS
                ids.append(tid)
            return ids
        finally:
            exp.shutdown()  # type: ignore[no-untyped-call]

    with ThreadPoolExecutor(8) as pool:
        ids = [tid for ids in pool.map(send, range(8)) for tid in ids]
    with otlp_process.client() as client:
        for tid in ids:
            assert weather_steps(trajectory(client, tid)["trace"]) == WEATHER_STEPS
        assert otlp_stats(client)["assembled_traces"] == 24


@pytest.mark.process
def test_kill_9_after_the_200_and_before_assembly(
    start_hub_process: Any, start_hub: Any, trace_server: dict[str, Any]
) -> None:
    hub = start_hub_process(trace_server, otlp={"quiet_seconds": 60})
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


# --- real instrumentations ----------------------------------------------------------


def _weather_model(body: dict[str, Any]) -> str | dict[str, Any]:
    """A model that calls get_weather, then answers from its result."""
    if body["messages"][-1]["role"] == "tool":
        return ANSWER
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_w1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


@pytest.mark.process
@pytest.mark.parametrize("instrumentation", ["openai-v2", "openinference"])
def test_an_instrumented_openai_agent_feeds_the_hub_by_environment_alone(
    otlp_process: HubProcess, fake_model: FakeModel, model_root: str, instrumentation: str
) -> None:
    fake_model.reply = _weather_model
    env = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_process.url,  # the SDK appends /v1/traces
        "OTEL_SERVICE_NAME": "weather-agent",
        "OTEL_SEMCONV_STABILITY_OPT_IN": "gen_ai_latest_experimental",
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "SPAN_AND_EVENT",
        "OPENAI_BASE_URL": f"{model_root}/v1",
        "OPENAI_API_KEY": fake_model.key,
    }
    agent = ROOT / "tests" / "support" / "otlp_agent.py"
    done = subprocess.run([sys.executable, str(agent), instrumentation], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    tid = done.stdout.strip()
    assert len(fake_model.received) == 2
    with otlp_process.client() as client:
        record = trajectory(client, tid)
    trace = record["trace"]
    assert trace["task"] == TASK
    assert weather_steps(trace) == WEATHER_STEPS
    assert (record["agent"], record["model"], record["env"]) == (
        "weather", "gpt-4o-mini", "weather-agent")
    if instrumentation == "openinference":  # it records the tools offered (llm.tools)
        assert trace["tools"] == ["get_weather"]


# --- OTLP/JSON and protobuf bodies ----------------------------------------------------


def _otlp_ingested(client: Any, outcome: str) -> float:
    return value(scrape(client)[1], "atropos_traces_ingested_total", format="otlp",
                 outcome=outcome)



def test_otlp_json_with_hex_or_base64_ids(otlp_hub: InProcessHub) -> None:
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
        # Counted as traces received once assembled (the counters are this process's).
        assert _otlp_ingested(client, "accepted") >= 2
        # The dashboard shows it as any trajectory.
        page = client.get(f"/ui/traces/{hexed}")
        assert page.status_code == 200 and TASK in page.text and "get_weather" in page.text


def test_unusable_spans_are_a_partial_success(otlp_hub: InProcessHub) -> None:
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


def test_a_body_that_does_not_decode_is_a_400_in_its_encoding(otlp_hub: InProcessHub) -> None:
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
        # JSON that only mentions resourceSpans is the hub's own, answered as such.
        trace = {"messages": [{"role": "user", "content": 'what is "resourceSpans"?'},
                              {"role": "assistant", "content": "OTLP's spans."}]}
        r = client.post("/v1/traces", json=trace)
        assert r.status_code == 202 and r.json()["stage"] != "rejected"


def test_more_spans_than_a_request_may_hold_is_a_413_before_any_is_read(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    hub = start_hub(trace_server, otlp={**QUIET, "max_spans_per_request": 3})
    with hub.client() as client:
        doc = document(weather_run(trace_id()))
        r = client.post("/v1/traces", content=protobuf(doc), headers=PROTOBUF)
        assert r.status_code == 413
        status = status_pb2.Status.FromString(r.content)
        assert status.code == 8 and "otlp.max_spans_per_request" in status.message
        r = client.post("/v1/traces", json=doc)
        assert r.status_code == 413
        assert r.json()["error"]["field"] == "otlp.max_spans_per_request"
        # Empty groups count too: a few kilobytes of gzip can hold millions of them.
        bomb = gzip.compress(b"\x0a\x00" * 1_000_000)
        r = client.post("/v1/traces", content=bomb,
                        headers={**PROTOBUF, "Content-Encoding": "gzip"})
        assert r.status_code == 413
        tid = trace_id()
        assert client.post("/v1/traces", json=document(weather_run(tid)[:3])).status_code == 200
        assert otlp_stats(client)["spans"] == 3


def test_a_rate_limited_exporter_gets_429_with_retry_after(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    hub = start_hub(trace_server, otlp=QUIET,
                    auth={"rate_limit_per_second": 0.2, "rate_limit_burst": 1})
    body = protobuf(document(weather_run(trace_id())))
    with hub.client() as client:
        assert client.post("/v1/traces", content=body, headers=PROTOBUF).status_code == 200
        r = client.post("/v1/traces", content=body, headers=PROTOBUF)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert status_pb2.Status.FromString(r.content).code == 8  # RESOURCE_EXHAUSTED


# --- assembly -------------------------------------------------------------------------


def test_a_span_after_assembly_scores_the_trajectory_again(otlp_hub: InProcessHub) -> None:
    tid = trace_id()
    spans = weather_run(tid)
    with otlp_hub.client() as client:
        assert client.post("/v1/traces", content=protobuf(document(spans)),
                           headers=PROTOBUF).status_code == 200
        first = trajectory(client, tid)
        verdict = span(tid, "evaluate", 10**18, {"atropos.reward": 1.0,
                                                 "atropos.outcome.status": "success"},
                       parent=spans[0]["spanId"])
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
        found = client.get("/v1/traces", params={"q": "WEATHER in paris"}).json()["traces"]
        assert [t["trace_id"] for t in found] == [tid]  # its search text, written again


def test_a_review_survives_the_trajectory_assembled_again(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Any
) -> None:
    """A run below the threshold, its reward overridden by a reviewer (still below); a
    late span carries a verdict that scores it far above: assembled and scored again,
    the review stands whole, its reward is still the trace's, and it is not batched."""
    # A review wakes no stage: the distributor judges it again within the flush interval.
    hub = start_hub({**trace_server, "flush_interval_seconds": 1}, otlp=QUIET, distributor={
        "target": "jsonl", "batch_size": 1, "min_reward_threshold": 5,
        "output_dir": str(tmp_path / "batches")})
    tid = trace_id()
    spans = weather_run(tid)
    review = {"label": "good", "note": "the tool answer was made up", "reward": 3.0}
    judged = ("below_threshold", "batched", "delivered")

    def settled(spans: int) -> Any:
        r = client.get(f"/v1/traces/{tid}").json()
        return r.get("stage") in judged and r["trace"]["metadata"]["spans"] == spans and r

    with hub.client() as client:
        assert client.post("/v1/traces", json=document(spans)).status_code == 200
        assert trajectory(client, tid)["reward"] == 0
        wait_until(lambda: settled(4), what="the run judged below the threshold")
        assert client.post(f"/v1/traces/{tid}/review", json=review).status_code == 200
        reviewed = wait_until(lambda: settled(4), what="the reviewed run judged again")
        verdict = span(tid, "evaluate", 400, {"atropos.outcome.status": "success",
                                              "atropos.reward": 1.0},
                       parent=spans[0]["spanId"])
        assert client.post("/v1/traces", json=document([verdict])).status_code == 200
        again = wait_until(lambda: settled(5), what="the run assembled and judged again")
        assert again["status"] == "success"
        assert again["reward_breakdown"]["env_reward"]["points"] == 20
        assert (again["stage"], again["reward"]) == ("below_threshold", 3.0)
        assert again["review"] == reviewed["review"]
        assert {k: again["review"][k] for k in review} == review
        assert client.get("/v1/batches").json()["batches"] == []


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


def test_a_trajectory_past_the_per_trace_bounds_is_made_of_its_first_spans_and_marked(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    """otlp.max_spans_per_trace and otlp.max_bytes_per_trace: the first spans by start
    time make the trajectory, which says how many were left out; several such traces
    due at once are read a few at a time (what a pass holds is bounded too), and each
    is made."""
    hub = start_hub(trace_server, otlp={**QUIET, "max_spans_per_trace": 3})
    tid = trace_id()
    with hub.client() as client:
        assert client.post("/v1/traces", json=document(weather_run(tid))).status_code == 200
        record = trajectory(client, tid)
        truncated = record["trace"]["metadata"]["truncated"]
        assert truncated["spans_left_out"] == 1
        assert "otlp.max_spans_per_trace (3)" in truncated["reason"]
        assert record["trace"]["metadata"]["spans"] == 3
        # The last chat span (the answer) is the one left out; the tool run is there.
        assert weather_steps(record["trace"])[:2] == WEATHER_STEPS[:2]
    hub.stop()  # one assembler on the database at a time

    one_span = len(protobuf(document(weather_run(trace_id())[1:2])))
    hub = start_hub(trace_server, otlp={**QUIET, "max_bytes_per_trace": 3 * one_span})
    ids = [trace_id() for _ in range(4)]
    with hub.client() as client:
        body = document([s for tid in ids for s in weather_run(tid)])
        assert client.post("/v1/traces", json=body).status_code == 200
        for tid in ids:
            metadata = trajectory(client, tid)["trace"]["metadata"]
            assert metadata["truncated"]["spans_left_out"] >= 1
            assert "otlp.max_bytes_per_trace" in metadata["truncated"]["reason"]
        assert otlp_stats(client)["assembled_traces"] == 1 + len(ids)


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
        refused_before = _otlp_ingested(client, "refused")
        assert client.post("/v1/traces", json=plain).status_code == 200
        posted = time.monotonic()
        wait_until(lambda: otlp_stats(client)["refused_traces"] == 1, what="the trace refused")
        assert _otlp_ingested(client, "refused") == refused_before + 1
        assert client.get(f"/v1/traces/{tid}").status_code == 404
        hub.wait_for_log(f"OTLP trace {tid} makes no trajectory")
        # Kept for otlp.max_wait_seconds after its last span (more might make it one).
        spans_now = staged(trace_server, tid)
        if time.monotonic() - posted < 7:
            assert spans_now
        wait_until(lambda: not staged(trace_server, tid), what="the refused spans dropped")
        assert otlp_stats(client)["refused_traces"] == 1


def _deep_key_run(tid: str) -> list[dict[str, Any]]:
    """The weather run with one OpenInference attribute whose key has 20,000 levels."""
    spans = weather_run(tid)
    deep = "llm.input_messages.0.message." + "x." * 20_000 + "y"
    return spans + [span(tid, "llm", 140, {"openinference.span.kind": "LLM", deep: "hi"},
                         parent=spans[0]["spanId"])]


def test_a_key_of_20000_levels_refuses_its_trace_and_assembly_goes_on(
    otlp_hub: InProcessHub,
) -> None:
    bad, good, after = trace_id(), trace_id(), trace_id()
    with otlp_hub.client() as client:
        for spans in (_deep_key_run(bad), weather_run(good)):
            assert client.post("/v1/traces", json=document(spans)).status_code == 200
        assert weather_steps(trajectory(client, good)["trace"]) == WEATHER_STEPS
        wait_until(lambda: otlp_stats(client)["refused_traces"] == 1, what="the trace refused")
        otlp_hub.wait_for_log(f"OTLP trace {bad} makes no trajectory")
        assert "at most 32 levels; this one has 20003" in otlp_hub.log
        assert client.get(f"/v1/traces/{bad}").status_code == 404
        # Assembly keeps up: the next run is taken and made a trajectory.
        assert client.post("/v1/traces", json=document(weather_run(after))).status_code == 200
        assert weather_steps(trajectory(client, after)["trace"]) == WEATHER_STEPS


def test_a_batch_with_a_key_of_20000_levels_refuses_that_item_alone(
    otlp_hub: InProcessHub,
) -> None:
    good = [trace_id(), trace_id()]
    body = {"traces": [document(weather_run(good[0])), document(_deep_key_run(trace_id())),
                       document(weather_run(good[1]))]}
    with otlp_hub.client() as client:
        r = client.post("/v1/traces", json=body)
        assert r.status_code == 207, r.text[:300]
        first, refused, last = r.json()["results"]
        assert refused["error"]["code"] == "invalid"
        assert "at most 32 levels" in refused["error"]["message"]
        assert "rejected" != first["stage"] == last["stage"]
        for tid in good:
            assert weather_steps(client.get(f"/v1/traces/{tid}").json()["trace"]) == WEATHER_STEPS


def test_a_nul_in_a_json_valued_attribute_is_stored_as_the_replacement_character(
    otlp_hub: InProcessHub,
) -> None:
    """An agent that printed a binary file: its message, written with json.dumps, holds
    NUL as the escape \\u0000, which the hub decodes. PostgreSQL's jsonb and text hold
    no NUL: stored with U+FFFD on both databases, and assembly goes on."""
    tid, after = trace_id(), trace_id()
    spans = weather_run(tid)
    printed = {"role": "tool", "parts": [{"response": "ELF\x00\x01 binary", "id": "call_w1",
                                          "type": "tool_call_response"}]}
    spans[3] = chat(tid, 130, [USER, CALLS, printed], [SAYS], parent=spans[0]["spanId"])
    assert "\\u0000" in json.dumps(printed)
    with otlp_hub.client() as client:
        assert client.post("/v1/traces", json=document(spans)).status_code == 200
        record = trajectory(client, tid)
        assert record["trace"]["steps"][1]["content"] == "ELF\ufffd\x01 binary"
        assert client.post("/v1/traces", json=document(weather_run(after))).status_code == 200
        assert weather_steps(trajectory(client, after)["trace"]) == WEATHER_STEPS
        assert otlp_stats(client)["refused_traces"] == 0


@pytest.mark.parametrize("kind", ["calls", "runs"])
def test_a_hostile_megabyte_of_spans_is_the_trajectory_sent_the_usual_way(
    otlp_hub: InProcessHub, kind: str
) -> None:
    """Through the ingest path that assembly takes (the ingest processes, the otlp
    format): thousands of model calls each saying one more message, or of tool runs
    without their call id, make the trajectory the same conversation makes when sent
    the usual way, each message in its place and each result after its own call (but
    for the final answer, which the hostile runs leave out). How long it takes:
    bench/otlp_assembly.py."""
    steps = {}
    with otlp_hub.client() as client:
        for hostile in (False, True):
            body = orjson.dumps({"traces": [megabyte(kind, hostile)]})
            assert 0.7 * 2**20 < len(body) < 1.3 * 2**20, (hostile, len(body))
            r = client.post("/v1/traces", content=body,
                            headers={"content-type": "application/json"})
            assert r.status_code == 207, r.text[:300]
            (result,) = r.json()["results"]
            assert result["stage"] != "rejected", result
            stored = client.get(f"/v1/traces/{result['trace_id']}").json()["trace"]
            steps[hostile] = stored["steps"]
    expected = steps[False] if kind == "calls" else steps[False][:-1]
    assert steps[True] == expected
    assert len(expected) == (3300 if kind == "calls" else 4400)


# --- secrets ----------------------------------------------------------------------------

OPENAI_KEY = "sk-proj-Fake0penAIkey1234567890abcdefGHIJ"
GITHUB_TOKEN = "ghp_Fake0123456789abcdefghijklmnopqrstuv"
AWS_SECRET = "wJalrXUtnFEMIfakeK7MDENGbPxRfiCY01234567"
SECRETS = (OPENAI_KEY, GITHUB_TOKEN, AWS_SECRET)


def _run_with_secrets(tid: str) -> dict[str, Any]:
    """The weather run with secrets where agents leave them: a message, a resource
    attribute (the command line), an event, and a value named as an AWS secret."""
    spans = weather_run(tid)
    user = {"role": "user", "parts": [{"type": "text",
                                       "content": f"{TASK} My key is {OPENAI_KEY}"}]}
    root = spans[0]["spanId"]
    spans[1] = chat(tid, 110, [user], [CALLS], parent=root)
    spans[3] = chat(tid, 130, [user, CALLS, TOOL], [SAYS], parent=root)
    spans[2]["events"] = [event("env", 121, {"AWS_SECRET_ACCESS_KEY": AWS_SECRET})]
    doc = document(spans)
    doc["resourceSpans"][0]["resource"]["attributes"] += attributes(
        {"process.command_line": f"agent --token {GITHUB_TOKEN}"})
    return doc


def _stored_bytes(trace_server: dict[str, Any], tid: str) -> list[bytes]:
    rows = db_execute(trace_server, "SELECT resource, scope, span FROM otlp_spans "
                      "WHERE trace_id = :t ORDER BY start_ns", t=tid)
    return [bytes(row[column]) for row in rows for column in ("resource", "scope", "span")]


@pytest.mark.parametrize("encoding", ["protobuf", "json"])
def test_secrets_are_redacted_from_spans_before_they_are_stored(
    start_hub: Any, trace_server: dict[str, Any], encoding: str
) -> None:
    hub = start_hub(trace_server, "--no-workers", otlp=QUIET)  # no assembly until drained
    tid = trace_id()
    doc = _run_with_secrets(tid)
    if encoding == "protobuf":
        body, headers = protobuf(doc), PROTOBUF
    else:
        # JSON may escape any character: the secret is still found.
        body = json.dumps(doc).replace("sk-proj-", "\\u0073k-proj-").encode()
        headers = {"Content-Type": "application/json"}
        assert OPENAI_KEY.encode() not in body
    with hub.client() as client:
        assert client.post("/v1/traces", content=body, headers=headers).status_code == 200
        stored = _stored_bytes(trace_server, tid)
        assert len(stored) == 12
        assert not [s for s in SECRETS if any(s.encode() in piece for piece in stored)]
        attrs = Span.FromString(stored[5]).attributes  # the first chat span's
        messages = next(a.value.string_value for a in attrs if a.key == "gen_ai.input.messages")
        assert "My key is [REDACTED:openai_api_key]" in messages
        assert "[REDACTED:github_token]" in str(ResourceSpans.FromString(stored[0]))

        wait_until(lambda: hub.drain() and client.get(f"/v1/traces/{tid}").status_code == 200,
                   what="the trajectory assembled")
        record = client.get(f"/v1/traces/{tid}").json()
        counts = {"openai_api_key": 2, "github_token": 1, "aws_secret_access_key": 1}
        assert record["trace"]["metadata"]["redactions"] == counts
        assert record["trace"]["task"] == f"{TASK} My key is [REDACTED:openai_api_key]"
        assert weather_steps(record["trace"]) == WEATHER_STEPS
        original = client.get(f"/v1/traces/{tid}", params={"view": "original"}).text
        assert "[REDACTED:aws_secret_access_key]" in original
        assert not [s for s in SECRETS if s in original or s in json.dumps(record)]
        assert client.get("/v1/stats").json()["redactions"] == counts


# --- back-pressure ----------------------------------------------------------------------


def test_overload_is_a_503_with_retry_after_in_the_requests_encoding(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    """With room for 4 spans on the write path and the database locked: a request of 4
    waits for the lock, the next is turned away at once, in its own encoding."""
    hub = start_hub(trace_server, "--no-workers", otlp=QUIET, limits={
        "max_queued_traces": 4, "max_traces_per_request": 4, "max_write_wait_seconds": 60,
        "retry_after_seconds": 3})
    body = protobuf(document(weather_run(trace_id())))

    def post() -> int:
        with hub.client() as c:
            return int(c.post("/v1/traces", content=body, headers=PROTOBUF).status_code)

    with hub.client() as client, ThreadPoolExecutor(1) as pool:
        one = document(weather_run(trace_id())[:1])
        assert client.post("/v1/traces", json=one).status_code == 200
        with write_lock(trace_server, "otlp_spans"):
            first = pool.submit(post)
            wait_until(lambda: hub.internals.spans.write_wait() > 0,
                       what="the spans' write waiting for the lock")
            refused = client.post("/v1/traces", content=protobuf(document(weather_run(
                trace_id()))), headers=PROTOBUF)
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "3"
            status = status_pb2.Status.FromString(refused.content)
            assert status.code == 14 and "limits.max_queued_traces" in status.message
            r = client.post("/v1/traces", json=one)
            assert r.status_code == 503 and r.json()["code"] == 14
            assert r.json()["error"]["field"] == "limits.max_queued_traces"
            assert not first.done()
        assert first.result(30) == 200
        assert otlp_stats(client)["spans"] == 5


def test_spans_are_taken_no_faster_than_they_become_trajectories(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    """Nothing assembles (a --no-workers hub before its worker starts): once a run has
    been due for longer than otlp.max_assembly_lag_seconds, an export waits, and once
    the worker has assembled the backlog it is taken."""
    hub = start_hub(trace_server, "--no-workers", otlp={**QUIET, "max_assembly_lag_seconds": 0.5})
    tid = trace_id()
    with hub.client() as client, ThreadPoolExecutor(1) as pool:
        assert client.post("/v1/traces", content=protobuf(document(weather_run(tid))),
                           headers=PROTOBUF).status_code == 200
        wait_until(lambda: hub.run(lambda h: h.spans.assembly_behind()) > 0.5,
                   what="the run waiting for its assembly")

        def export() -> int:
            with hub.client() as c:
                return int(c.post("/v1/traces", content=protobuf(document(weather_run(trace_id()))),
                                  headers=PROTOBUF).status_code)

        held = pool.submit(export)
        hub.drain()  # the worker catches up
        assert held.result(30) == 200
        assert trajectory(client, tid)["trace_id"] == tid


def test_an_export_that_waits_too_long_for_the_assembly_is_a_503_with_retry_after(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    """...up to limits.max_write_wait_seconds, then 503 with Retry-After, in the
    request's encoding, and nothing of it is stored."""
    hub = start_hub(trace_server, "--no-workers",
                    otlp={**QUIET, "max_assembly_lag_seconds": 0.5},
                    limits={"max_write_wait_seconds": 0.5})
    tid = trace_id()
    with hub.client() as client:
        assert client.post("/v1/traces", content=protobuf(document(weather_run(tid))),
                           headers=PROTOBUF).status_code == 200
        wait_until(lambda: hub.run(lambda h: h.spans.assembly_behind()) > 0.5,
                   what="the run waiting for its assembly")
        refused = client.post("/v1/traces", content=protobuf(document(weather_run(trace_id()))),
                              headers=PROTOBUF)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        status = status_pb2.Status.FromString(refused.content)
        assert status.code == 14 and "otlp.max_assembly_lag_seconds" in status.message
        as_json = client.post("/v1/traces", json=document(weather_run(trace_id())))
        assert as_json.status_code == 503
        assert as_json.json()["error"]["field"] == "otlp.max_assembly_lag_seconds"
        assert otlp_stats(client)["spans"] == len(weather_run(tid))  # the first run's alone


def test_spans_not_committed_within_the_write_wait_are_a_503_and_stored_once_when_resent(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    hub = start_hub(trace_server, "--no-workers", otlp=QUIET, limits={
        "max_write_wait_seconds": 1, "retry_after_seconds": 2})
    body = protobuf(document(weather_run(trace_id())))
    with hub.client() as client:
        with write_lock(trace_server, "otlp_spans"):
            started = time.monotonic()
            r = client.post("/v1/traces", content=body, headers=PROTOBUF)
            assert time.monotonic() - started < 10
            assert r.status_code == 503 and r.headers["retry-after"] == "2"
            assert "limits.max_write_wait_seconds" in status_pb2.Status.FromString(
                r.content).message
        # As the exporter retries: stored, and once, whatever the first attempt became.
        resent = wait_until(
            lambda: (a := client.post("/v1/traces", content=body, headers=PROTOBUF))
            .status_code == 200 and a, what="the resend taken")
        assert ExportTraceServiceResponse.FromString(resent.content).partial_success.rejected_spans == 0
        assert otlp_stats(client)["spans"] == 4
