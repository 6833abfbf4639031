"""What nine real framework setups sent (/work/shared/reference/otel-captures: each
setup's spans, and what it sent the model and got back), posted to a hub's OTLP
endpoint as their exporters posted them: each run is one trajectory that matches what
the model really did and saw, or a refusal that says what the sender should change."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.support.captures import CAPTURES, Truth, document, model_log, spans, truth
from tests.support.hubs import InProcessHub
from tests.support.otlp import QUIET, otlp_stats, trajectory
from tests.support.waiting import wait_until

SETUPS = sorted(p.name for p in CAPTURES.iterdir() if p.is_dir()) if CAPTURES.is_dir() else []
pytestmark = pytest.mark.skipif(not SETUPS, reason=f"no captures at {CAPTURES}")


@pytest.fixture
def otlp_hub(start_hub: Any, trace_server: dict[str, Any]) -> InProcessHub:
    hub: InProcessHub = start_hub(trace_server, otlp=QUIET)
    return hub


def _scenarios(setup: str) -> list[str]:
    return sorted(p.name.removesuffix(".spans.json")
                  for p in (CAPTURES / setup).glob("*.spans.json")
                  if p.name != "bare.spans.json")


@pytest.mark.parametrize("dialect", ["sqlite"])
@pytest.mark.parametrize("setup", SETUPS)
def test_each_run_is_the_trajectory_the_model_had(otlp_hub: InProcessHub, setup: str) -> None:
    with otlp_hub.client() as client:
        for scenario in _scenarios(setup):
            captured = spans(setup, scenario)
            assert client.post("/v1/traces", json=document(captured)).status_code == 200
        for scenario in _scenarios(setup):
            captured = spans(setup, scenario)
            stored = trajectory(client, captured[0]["trace_id"])["trace"]
            matches(stored, truth(model_log(setup, scenario)), f"{setup}/{scenario}")


# What the model was sent that no span records: PydanticAI's spans hold a tool's retry
# prompt as its message ("no such city: Atlantis") where the model got it wrapped
# ('{"error":"no such city: Atlantis"}'). docs/otlp.md says so.
_NOT_IN_THE_SPANS = {("pydantic-ai/tool_error", "call_fake004"): "no such city: Atlantis"}


def matches(trace: dict[str, Any], real: Truth, where: str,
            agent: str | None = "weather_agent") -> None:
    """A stored trajectory against what its run really sent the model and got back."""
    steps = trace["steps"]
    assert trace["task"] == real.task, where
    named = {"name": agent} if agent is not None else {}
    assert trace["agent"] == {**named, "model": real.model}, where
    # The model's own calls, each once, in order; none it did not make.
    actions = [(s.get("tool"), s.get("arguments"), s.get("call_id")) for s in steps if s["type"] == "action"]
    assert actions == real.calls, where
    for _, _, call_id in real.calls:
        answers = [s for s in steps if s["type"] == "observation" and s.get("call_id") == call_id]
        assert len(answers) == 1, (where, call_id)
        if (where, call_id) in _NOT_IN_THE_SPANS:
            assert _NOT_IN_THE_SPANS[where, call_id] in answers[0]["content"], where
        elif call_id in real.results:
            assert answers[0].get("content", "") == real.results[call_id], (where, call_id)
        elif call_id in real.last_calls:  # the run ended: the tool's own result or error
            assert answers[0].get("content"), (where, call_id)
        else:
            assert answers[0].get("content", "").strip() in real.seen, (where, call_id)
    # Every assistant text once, in order; the last answer is the final step.
    said = [s.get("content") for s in steps if s.get("content") and (
        s["type"] in ("final", "action") or (s["type"] == "message"
                                             and s.get("role") == "assistant"))]
    assert said == real.texts, where
    if real.last_text is not None:
        assert steps[-1] == {"type": "final", "content": real.last_text}, where
    # Later user turns once, after the answer to the first.
    users = [s.get("content") for s in steps if s["type"] == "message" and s.get("role") == "user"]
    if where.endswith("two_turns"):
        assert len([u for u in users if "London?" in u]) == 1, where
    if where.endswith("tool_error"):
        failed = [s for s in steps if s["type"] == "observation" and s.get("error")]
        told = [u for u in users if "no such city" in u]
        assert failed or told, where
    assert trace["metadata"]["usage"] == {"input_tokens": real.usage[0],
                                          "output_tokens": real.usage[1]}, where


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
@pytest.mark.parametrize("together", [True, False], ids=["one-request", "call-by-call"])
def test_a_bare_clients_calls_of_one_conversation_are_one_trajectory(
    otlp_hub: InProcessHub, together: bool
) -> None:
    """openai-v2 with no agent span: each model call is a trace of its own, the second
    one's messages extending the first's. They make one trajectory, under the first
    call's trace id, whether they come in one request or the second after the first
    was assembled."""
    captured = spans("openai-v2", "bare")
    first, second = captured[0]["trace_id"], captured[1]["trace_id"]
    assert first != second
    with otlp_hub.client() as client:
        if together:
            assert client.post("/v1/traces", json=document(captured)).status_code == 200
        else:
            assert client.post("/v1/traces", json=document(captured[:1])).status_code == 200
            alone = trajectory(client, first)["trace"]  # the first call: the model's call
            assert [s["type"] for s in alone["steps"]][-1:] == ["action"]
            assert client.post("/v1/traces", json=document(captured[1:])).status_code == 200
        wait_until(lambda: otlp_stats(client)["open_traces"] == 0
                   and otlp_stats(client)["assembled_traces"] == 2, what="both calls assembled")
        stored = trajectory(client, first)["trace"]
        matches(stored, truth(model_log("openai-v2", "bare")), "openai-v2/bare", agent=None)
        assert client.get(f"/v1/traces/{second}").status_code == 404
        listed = client.get("/v1/traces").json()
        assert [t["trace_id"] for t in listed["traces"]] == [first]


_CONTENT = ("gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.system_instructions")


def _as_another_run(captured: list[dict[str, Any]], **drop: bool) -> list[dict[str, Any]]:
    """The same spans under a new trace id, without message content when `content`."""
    tid = os.urandom(16).hex()
    return [{**s, "trace_id": tid,
             "attributes": {k: v for k, v in s["attributes"].items()
                            if not (drop.get("content") and k in _CONTENT)}}
            for s in captured]


@pytest.mark.parametrize("dialect", ["sqlite"])
def test_spans_without_message_content_are_refused_visibly_once_per_service_and_reason(
    otlp_hub: InProcessHub,
) -> None:
    """openai-v2 with OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true: its chat
    spans carry no messages, the agent's own execute_tool spans do."""
    runs = [_as_another_run(spans("openai-v2", "basic"), content=True) for _ in range(3)]
    with otlp_hub.client() as client:
        for run in runs:
            assert client.post("/v1/traces", json=document(run)).status_code == 200
        wait_until(lambda: otlp_stats(client)["refused_traces"] == 3, what="3 refusals")
        refusals = client.get("/v1/stats").json()["otlp"]["refusals"]
        assert len(refusals) == 1 and refusals[0]["traces"] == 3
        reason = refusals[0]["reason"]
        assert reason.startswith("service rv-openai-v2: ")
        assert "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_AND_EVENT" in reason
        for run in runs:  # kept, not made into a trajectory with no task
            assert client.get(f"/v1/traces/{run[0]['trace_id']}").status_code == 404
        warnings = [line for line in otlp_hub.log.splitlines()
                    if " WARNING " in line and "make no trajectory" in line]
        assert len(warnings) == 1 and reason in warnings[0]
        page = client.get("/ui")
        assert page.status_code == 200
        shown = page.text[page.text.index('id="otlp-refusals"'):]
        assert "service rv-openai-v2" in shown
        assert "CAPTURE_MESSAGE_CONTENT=SPAN_AND_EVENT" in shown


@pytest.mark.parametrize("dialect", ["sqlite"])
def test_a_run_without_the_models_answer_is_refused_not_stored(otlp_hub: InProcessHub) -> None:
    """A trajectory with no assistant turn would be batched, exported and paired as
    training data with nothing to learn."""
    captured = _as_another_run(spans("openai-v2", "basic"))
    # The run's first model call, its answer not recorded, and the agent's root span.
    first = next(s for s in captured if s["name"].startswith("chat"))
    first["attributes"].pop("gen_ai.output.messages")
    run = [first] + [s for s in captured if not s["parent_span_id"]]
    with otlp_hub.client() as client:
        assert client.post("/v1/traces", json=document(run)).status_code == 200
        wait_until(lambda: otlp_stats(client)["refused_traces"] == 1, what="the refusal")
        [refusal] = client.get("/v1/stats").json()["otlp"]["refusals"]
        assert "no assistant turn" in refusal["reason"]
        assert client.get(f"/v1/traces/{run[0]['trace_id']}").status_code == 404
