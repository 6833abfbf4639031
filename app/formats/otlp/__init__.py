"""OTLP traces: the spans of one agent run (one OTel trace) as one trajectory.

    {"resourceSpans": [{"resource", "scopeSpans": [{"scope", "spans": [...]}]}]}

This is what the assembly stage (app/stages/assembly.py) stores as a trajectory's
original: OTLP/JSON of every span the hub received for the trace. An item of a batch
in this shape is read the same way, as one whole run. docs/otlp.md documents the
mapping with an example per convention; in short:

- Model calls (GenAI `chat` spans in any of their forms, OpenInference LLM spans) and
  tool runs (`execute_tool`, OpenInference TOOL) make one conversation, each message
  once and in order (app/formats/otlp/conversation.py); it is then read as OpenAI
  chat messages are (app/formats/openai.py): the first user message is the task, the
  last assistant text the final answer.
- trace_id is the OTel trace id (32 hex digits). Model: `gen_ai.request.model` (or
  `llm.model_name`); agent: `gen_ai.agent.name` (or `agent.name`); env: an
  `atropos.env` attribute, else the resource's `service.name`.
- Outcome: an `atropos.outcome.status` attribute on any span (the root's first), else
  failure when the root span's status is ERROR, else unknown. Reward: `atropos.reward`,
  else the score of a `gen_ai.evaluation.result` event (the root span's first, else
  the last); it is the environment's reward, carried as the top-level `reward` every
  format reads.
- A trace without its root span (assembled after otlp.max_wait_seconds) is marked
  `metadata.incomplete`.
- A bare instrumented client (no agent span around its model calls) sends each call
  as a trace of its own, one model-call span. Such calls join into one run when each
  call's messages begin with the last one's messages and answer (the conversation
  digests of app/formats/stitching.py, which the gateway stitches calls by): the
  assembly stage finds the run a call continues (`bare_call`), and an item holding
  the spans of several traces is read as one run only when they chain so; its id is
  the first trace's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

from app.domain import Step, StepType, Trace
from app.formats import _common as c
from app.formats import openai, stitching
from app.formats.otlp import genai, langfuse, openinference, wire
from app.formats.otlp.conversation import (
    Exchange,
    ToolRun,
    one_conversation,
    openai_messages,
    tool_errors,
)
from app.formats.otlp.spans import Span, read
from app.formats.spec import Format

NAME = "otlp"
EVALUATION_EVENT = "gen_ai.evaluation.result"
# Why a trace makes no trajectory, each saying what the sender should change. The same
# words for every trace (the trace id is beside them in the log): the hub warns once
# per service and reason.
_CAPTURE = ("turn message capture on: for opentelemetry-instrumentation-openai-v2 "
            "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_AND_EVENT (not true) "
            "with OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental; "
            "see docs/otlp.md for the other frameworks")
NO_CONTENT = ("the spans carry no messages, tool runs or agent input: nothing to make a "
              "trajectory of; " + _CAPTURE)
NO_MESSAGES = ("the model-call spans carry no messages (the model's input and output are "
               "not recorded); " + _CAPTURE)
NO_TASK = ("no task: no model call was sent a user message and no agent span holds an "
           "input; record the messages the model was sent (" + _CAPTURE + ")")
NO_ASSISTANT = ("no assistant turn: no model call's answer was recorded; record the "
                "model's output messages (" + _CAPTURE + ")")


def looks_like(item: dict[str, Any]) -> bool:
    return "resourceSpans" in item


def load(raw: bytes) -> dict[str, Any]:
    """An OTLP protobuf ExportTraceServiceRequest (the assembly stage's item) as OTLP/JSON."""
    return wire.to_json(wire.from_protobuf(raw))


@dataclass(frozen=True, slots=True)
class BareCall:
    """A trace that is one model call and nothing else: the digests of the conversations
    it continues (`prefixes`) and of the one a call continuing it begins with."""

    prefixes: list[str]
    continues: str | None


def bare_call(item: dict[str, Any]) -> BareCall | None:
    """The trace's conversation digests when it is a bare client's model call."""
    return _bare(read(item))


def _bare(spans: list[Span]) -> BareCall | None:
    if len(spans) != 1:
        return None
    said = _exchange(spans[0])
    if said is None or not said.model:
        return None
    messages = openai_messages(one_conversation([said], []))
    answered = bool(said.outputs) and bool(messages) and messages[-1]["role"] == "assistant"
    sent = messages[:-1] if answered else messages
    return BareCall(stitching.prefixes(sent),
                    stitching.continuation(sent, messages[-1] if answered else None))


def _exchange(span: Span) -> Exchange | None:
    return genai.exchange(span) or openinference.exchange(span) or langfuse.exchange(span)


def _run_id(spans: list[Span]) -> str:
    """The id of the run the spans are: their trace's; for a bare client's calls
    joined, the first call's trace's, when each later call continues an earlier one."""
    traces: dict[str, list[Span]] = {}
    for span in sorted(spans, key=lambda s: s.start):
        traces.setdefault(span.trace_id, []).append(span)
    if len(traces) == 1:
        return spans[0].trace_id
    continued: set[str | None] = set()
    for i, members in enumerate(traces.values()):
        call = _bare(members)
        if call is None or (i and not continued.intersection(call.prefixes)):
            c.fail("resourceSpans", f"holds the spans of {len(traces)} traces; a trajectory "
                   "is the spans of one trace, or the model calls of a bare client, each "
                   "continuing the conversation of one before it")
        continued.add(call.continues)
    return next(iter(traces))


def parse(item: dict[str, Any]) -> Trace:
    spans = read(item)
    if not spans:
        c.fail("resourceSpans", "holds no spans")
    trace_id = _run_id(spans)
    sender = _service(spans)
    exchanges: list[Exchange] = []
    runs: list[ToolRun] = []
    offered: list[Any] = []
    model_calls = 0
    for span in spans:
        said = _exchange(span)
        if said is not None:
            exchanges.append(said)
        model_calls += _model_call(span)
        run = genai.tool_run(span) or openinference.tool_run(span) or langfuse.tool_run(span)
        if run is not None:
            runs.append(run)
        offered += genai.tools(span) + openinference.tools(span) + langfuse.tools(span)
    if model_calls and not exchanges:
        # Tool spans alone would make calls the model's record does not hold.
        _refuse(NO_MESSAGES, sender)
    conversation = one_conversation(exchanges, runs)
    messages = openai_messages(conversation)
    if not exchanges:
        _agent_io(spans, messages)
    if not messages:
        _refuse(NO_CONTENT, sender)
    roots = [span for span in spans if span.root]
    first = roots + [span for span in spans if not span.root]
    record: dict[str, Any] = {
        "trace_id": trace_id,
        "messages": messages,
        "agent": {"name": _first(first, "gen_ai.agent.name", "agent.name", "agent_name")
                  or openinference.agent_name(spans) or langfuse.agent_name(spans),
                  "model": _first(first, "gen_ai.request.model", "llm.model_name",
                                  langfuse.MODEL, "gen_ai.response.model")},
        "env": _first(first, "atropos.env") or _service(first),
        "policy_version": _first(first, "atropos.policy_version"),
        "metadata": _metadata(spans, roots),
        "outcome": _outcome(first, roots),
    }
    tools = _tools(offered, runs)
    if tools:
        record["tools"] = tools
    reward = _reward(first, roots)
    if reward is not None:
        record["reward"] = reward
    trace = openai.parse(record)
    _check(trace, sender)
    return trace.model_copy(update={"source_format": NAME,
                                    "steps": _with_errors(trace.steps, tool_errors(conversation))})


def _model_call(span: Span) -> bool:
    return (genai.model_call(span) or openinference.kind(span) == "LLM"
            or langfuse.kind(span) == "generation")


def _check(trace: Trace, sender: str | None) -> None:
    """A trajectory is a task and what the model did with it: without either it is no
    training data, and refused, with what the sender should change."""
    if not trace.task.strip():
        _refuse(NO_TASK, sender)
    if not any(step.type in _ASSISTANT_STEPS
               or (step.type == StepType.MESSAGE and step.role == "assistant")
               for step in trace.steps):
        _refuse(NO_ASSISTANT, sender)


def _refuse(reason: str, sender: str | None) -> NoReturn:
    """The same words for every trace of a service refused for one reason: the hub
    warns of each once and counts them (/v1/stats otlp.refusals)."""
    c.fail(None, f"service {sender or '(unnamed)'}: {reason}")


_ASSISTANT_STEPS = (StepType.ACTION, StepType.FINAL, StepType.THOUGHT)


def _with_errors(steps: list[Step], errors: list[str | None]) -> list[Step]:
    """The tool runs' errors on their results, whose text stays what the model saw."""
    observations = [i for i, step in enumerate(steps) if step.type == StepType.OBSERVATION]
    if len(observations) != len(errors) or not any(errors):
        return steps
    out = list(steps)
    for i, error in zip(observations, errors):
        if error is not None:
            out[i] = out[i].model_copy(update={"error": error})
    return out


def _agent_io(spans: list[Span], messages: list[dict[str, Any]]) -> None:
    """The outermost AGENT (or CHAIN) span's input and output stand for the task and
    the answer when no model call carried them."""
    agents = [s for s in spans if openinference.kind(s) in ("AGENT", "CHAIN")]
    if not agents:
        return
    outer = next((s for s in agents if s.root), agents[0])
    task = openinference.task(outer)
    if task and not any(m["role"] == "user" for m in messages):
        leading = next((i for i, m in enumerate(messages) if m["role"] != "system"),
                       len(messages))
        messages.insert(leading, {"role": "user", "content": task})
    answer = openinference.answer(outer)
    last = messages[-1] if messages else None
    said_last = last is not None and last["role"] == "assistant" and not last.get("tool_calls")
    if answer and not said_last:
        messages.append({"role": "assistant", "content": answer})


def _first(spans: list[Span], *keys: str) -> str | None:
    for key in keys:
        for span in spans:
            value = span.attrs.get(key)
            if value is not None and value != "":
                return str(value)
    return None


def _service(spans: list[Span]) -> str | None:
    for span in spans:
        name = span.resource.get("service.name")
        # The SDK's default when the agent set none says nothing about the environment.
        if isinstance(name, str) and name and not name.startswith("unknown_service"):
            return name
    return None


def _outcome(spans: list[Span], roots: list[Span]) -> dict[str, Any]:
    stated = _first(spans, "atropos.outcome.status")
    if stated is not None:
        return {"status": c.status(stated, "atropos.outcome.status").value}
    failed = next((span for span in roots if span.failed), None)
    if failed is not None:
        return {"status": "failure", "reason": failed.status_message or None}
    return {}


def _reward(spans: list[Span], roots: list[Span]) -> float | None:
    for span in spans:
        if "atropos.reward" in span.attrs:
            return _number(span.attrs["atropos.reward"], "atropos.reward")
    scores = [
        (not span.root, -event.time, event.attrs["gen_ai.evaluation.score.value"])
        for span in spans
        for event in span.events
        if event.name == EVALUATION_EVENT and "gen_ai.evaluation.score.value" in event.attrs
    ]
    if not scores:
        return None
    # The root span's verdict on the run first; else the latest one.
    return _number(min(scores, key=lambda s: (s[0], s[1]))[2], "gen_ai.evaluation.score.value")


def _number(value: Any, where: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            c.fail(where, f"expected a number, got {value[:40]!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        c.fail(where, f"expected a number, got {c.type_name(value)}")
    return float(value)


def _metadata(spans: list[Span], roots: list[Span]) -> dict[str, Any]:
    metadata: dict[str, Any] = {"spans": len(spans)}
    if not roots:
        metadata["incomplete"] = True
    # Runs of one task pair for DPO by it (app/formats/dataset.py task_key).
    task_id = _first(roots + [s for s in spans if not s.root], "atropos.task_id")
    if task_id:
        metadata["task_id"] = task_id
    conversation_id = _first(spans, "gen_ai.conversation.id", "session.id")
    if conversation_id:
        metadata["conversation_id"] = conversation_id
    evaluations = [
        {key.removeprefix("gen_ai.evaluation."): value for key, value in event.attrs.items()
         if key.startswith("gen_ai.evaluation.")}
        for span in spans
        for event in span.events
        if event.name == EVALUATION_EVENT
    ]
    if evaluations:
        metadata["evaluations"] = evaluations
    usage = {"input_tokens": 0, "output_tokens": 0}
    for span in spans:
        a = span.attrs
        counted = langfuse.usage(span)
        if counted is not None:
            usage["input_tokens"] += counted[0]
            usage["output_tokens"] += counted[1]
            continue
        # Model calls only: an agent span may repeat the sum of its calls.
        if not _model_call(span):
            continue
        usage["input_tokens"] += _count(a.get("gen_ai.usage.input_tokens",
                                              a.get("llm.token_count.prompt")))
        usage["output_tokens"] += _count(a.get("gen_ai.usage.output_tokens",
                                               a.get("llm.token_count.completion")))
    if any(usage.values()):
        metadata["usage"] = usage
    return metadata


def _count(value: Any) -> int:
    """A token count, written as a number or (Logfire) as its digits."""
    if isinstance(value, str) and value.isdecimal() and len(value) < 20:
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _tools(offered: list[Any], runs: list[ToolRun]) -> list[Any]:
    """Each tool once: its schema where a model call was offered one, else its name."""
    seen: dict[str, Any] = {}
    for schema in offered:
        inner = schema.get("function") if isinstance(schema.get("function"), dict) else schema
        name = inner.get("name")
        if isinstance(name, str) and name not in seen:
            seen[name] = schema
    for run in runs:
        seen.setdefault(run.name, run.name)
    return list(seen.values())


FORMAT = Format(
    NAME,
    parse,
    looks_like,
    detected_by="'resourceSpans'",
    # A trajectory in OTLP is the spans it was assembled from; it is exported in the
    # other formats.
    load=load,
)
