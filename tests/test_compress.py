from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

import app.compression.ledger as ledger_module
import app.tokens
from app.compression import Compressed, ModelSummarizer, Skipped, compress
from app.compression.compress import _budget
from app.compression.extract import (
    TIGHT_KEEP,
    _collapse_repeats,
    _dedup,
    key_decision_extract,
    shape,
)
from app.compression.ledger import Budget, Ledger, is_error
from app.compression.summarize import PREFIX, _span, _turns
from app.config import CompressionConfig, ModelRetry, TinkerConfig
from app.domain import Step, StepType, Trace
from app.llm import LLMError
from app.tokens import count_parts
from tests.support.fakes.model_server import FakeModel
from tests.support.real_traces import OPENHANDS, SWE_AGENT, load

REAL = OPENHANDS + SWE_AGENT
# The long runs: OpenHands multi_swe_bench (50-80k raw tokens) and the longer SWE-agent ones.
LONG = OPENHANDS + [p for p in SWE_AGENT if p.name.startswith(("ctf_web", "marshmallow"))]
KEY, KEY_ENV = FakeModel.key, "FAKE_SUMMARY_KEY"


def _ids(paths: list[Path]) -> list[str]:
    return [p.name.split(".")[0][-24:] for p in paths]


def total(trace: Trace) -> int:
    return count_parts(trace.text_parts())


async def compressed(trace: Trace, policy: CompressionConfig, **kwargs: object) -> Compressed:
    result = await compress(trace, total(trace), policy, **kwargs)  # type: ignore[arg-type]
    assert isinstance(result, Compressed), result
    return result


# --- key_decision_extract on real runs ----------------------------------------------


@pytest.mark.parametrize("path", REAL, ids=_ids(REAL))
async def test_real_runs_land_within_bounds(path: Path) -> None:
    trace = load(path)
    policy = CompressionConfig()
    result = await compress(trace, total(trace), policy)
    if isinstance(result, Skipped):
        assert result.kind in ("small", "min_saving"), result
        if result.kind == "small":
            assert policy.ratio * total(trace) < policy.min_tokens_after
        return
    assert result.tokens_after == total(result.trace)  # same tokenizer, same text
    assert policy.min_tokens_after <= result.tokens_after <= 0.9 * total(trace)
    assert result.over_limit == (result.tokens_after > policy.max_tokens_after)
    assert result.target == min(max(round(0.3 * total(trace)), 500), 8000)
    if result.tokens_after > 1.25 * result.target:
        _assert_only_kept_parts_left(trace, policy, result.target)


def _assert_only_kept_parts_left(trace: Trace, policy: CompressionConfig, target: int) -> None:
    """Over 25% above target is allowed only when every pass ran: no thought left that
    may go, and no output left that the tightest cut could still shorten."""
    ledger = Ledger.of(trace)
    key_decision_extract(ledger, policy, _budget(target, policy))
    found = shape(trace, policy)
    thoughts = [i for i, s in enumerate(ledger.steps)
                if s is not None and s.type is StepType.THOUGHT and i not in found.protected
                and ledger.can_drop([i])]
    assert thoughts == []
    budget = Budget(aim=0, floor=0, lower=0)
    for i, step in enumerate(ledger.steps):
        if step is not None and step.type is StepType.OBSERVATION and i not in found.protected:
            assert not ledger.trim(i, TIGHT_KEEP, "x", budget, found.needed(i)), i


@pytest.mark.parametrize("path", LONG, ids=_ids(LONG))
async def test_long_runs_keep_task_final_action_and_every_error(path: Path) -> None:
    trace = load(path)
    result = await compressed(trace, CompressionConfig())
    out = result.trace
    assert result.tokens_after <= 0.9 * total(trace)
    assert out.task == trace.task and out.outcome == trace.outcome
    assert out.metadata["sft_only"] is True
    _assert_final_action_kept(trace, out)
    _assert_errors_kept_with_context(trace, out)


def _assert_final_action_kept(trace: Trace, out: Trace) -> None:
    finals = [s for s in trace.steps if s.type is StepType.FINAL]
    if finals:
        assert finals[-1] in out.steps
        return
    last = [s for s in trace.steps if s.type is StepType.ACTION][-1]
    assert last in out.steps
    assert any(s.type is StepType.OBSERVATION and s.call_id == last.call_id for s in out.steps)


def _assert_errors_kept_with_context(trace: Trace, out: Trace) -> None:
    errors = [i for i, s in enumerate(trace.steps) if is_error(s)]
    kept_text = [s.content or "" for s in out.steps]
    for i in errors:
        error = trace.steps[i]
        head = (error.content or "")[:60]
        assert any(text.startswith(head) for text in kept_text), f"error at step {i} lost"
        if error.call_id:
            assert any(s.type is StepType.ACTION and s.call_id == error.call_id for s in out.steps)
        reaction = next(
            (s for s in trace.steps[i + 1 :] if s.type is not StepType.OBSERVATION), None
        )
        if reaction is not None:
            assert any(_same_step(reaction, s) for s in out.steps), f"reaction to step {i} lost"


def _same_step(original: Step, kept: Step) -> bool:
    if original.type is not kept.type:
        return False
    if original.type is StepType.ACTION:
        return original.call_id == kept.call_id
    return (kept.content or "").startswith((original.content or "")[:60])


async def test_long_outputs_are_cut_to_head_and_tail_with_a_marker() -> None:
    trace = load(OPENHANDS[2])
    result = await compressed(trace, CompressionConfig())
    cut = [s for s in result.trace.steps if s.content and "tokens of output elided …]" in s.content]
    assert cut and result.removed["redundant_tool_outputs"] == len(cut)
    original = {s.call_id: s.content or "" for s in trace.steps if s.type is StepType.OBSERVATION}
    for step in cut:
        # What is kept is the original's text, in order, between the markers.
        content = (step.content or "").split("\n[… the same call, with the same result")[0]
        kept = MARKER_RE.split(content)
        text, at = original[step.call_id], 0
        assert text.startswith(kept[0]) and text.endswith(kept[-1])
        for piece in kept:
            found = text.find(piece.strip(), at)
            assert found >= 0, piece
            at = found + len(piece.strip())


MARKER_RE = re.compile(r"\s?\[… [\d,]+ tokens of output elided …\]\s?")


def test_an_elided_output_keeps_the_lines_a_later_turn_uses() -> None:
    listing = "\n".join(f"row {k:04d}: status ok, nothing to see here at all" for k in range(300))
    listing = listing.replace("row 0150: status ok", "row 0150: build_id=HX42Q7 failed")
    trace = Trace(task="Find the failing build.", steps=[
        Step(type=StepType.ACTION, tool="bash", arguments={"cmd": "list"}, call_id="c"),
        Step(type=StepType.OBSERVATION, call_id="c", content=listing),
        Step(type=StepType.FINAL, content="Build HX42Q7 failed."),
    ])
    ledger = Ledger.of(trace)
    found = shape(trace, CompressionConfig())
    assert ledger.trim(1, 64, "redundant_tool_outputs", Budget(0, 0, 0), found.needed(1))
    trimmed = ledger.steps[1]
    assert trimmed is not None
    out = trimmed.content or ""
    assert "row 0150: build_id=HX42Q7 failed, nothing to see here at all" in out.splitlines()
    assert out.startswith("row 0000") and out.endswith("row 0299: status ok, nothing to see here at all")
    [before, after] = MARKER_RE.findall(out)
    elided = [int(n.replace(",", "")) for n in re.findall(r"([\d,]+) tokens of output", out)]
    assert all(n > 500 for n in elided)
    assert "row 0100" not in out


async def test_tighter_passes_then_over_limit() -> None:
    trace = load(OPENHANDS[0])  # an error streak: mostly preserved
    result = await compressed(trace, CompressionConfig(ratio=0.1, max_tokens_after=3000))
    assert result.over_limit and result.tokens_after > 3000
    assert result.record()["ratio"] == result.ratio > 0.1
    # Every call stays, with its result.
    assert [s for s in result.trace.steps if s.type is StepType.ACTION] == [
        s for s in trace.steps if s.type is StepType.ACTION]


async def test_a_saving_under_min_saving_keeps_the_trace_whole() -> None:
    trace = load(OPENHANDS[2])
    done = await compressed(trace, CompressionConfig())
    saving = 1 - done.tokens_after / done.tokens_before
    policy = CompressionConfig(min_saving=round(saving + 0.05, 2))
    result = await compress(trace, total(trace), policy)
    assert isinstance(result, Skipped) and result.kind == "min_saving"
    assert f"under compression.min_saving {policy.min_saving:.0%}" in result.reason


def test_system_prompt_cannot_be_dropped() -> None:
    with pytest.raises(ValueError, match="never alters the system prompt"):
        CompressionConfig(drop_fields=["system_prompt"])  # type: ignore[list-item]


@pytest.mark.parametrize("path", REAL, ids=_ids(REAL))
async def test_never_under_min_tokens_after(path: Path) -> None:
    trace = load(path)
    policy = CompressionConfig(ratio=0.05, min_tokens_after=1000)
    result = await compress(trace, total(trace), policy, forced=True)
    if isinstance(result, Skipped):
        assert total(trace) <= 1000
        return
    assert result.target == max(round(0.05 * total(trace)), 1000)
    assert result.tokens_after >= 1000


def test_counts_are_kept_per_step_not_retokenized(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole trace is tokenized about once (incl. the result), not once per removal."""
    encoded = [0]
    real = app.tokens.count_tokens

    def counting(text: str) -> int:
        encoded[0] += len(text)
        return real(text)

    monkeypatch.setattr(app.tokens, "count_tokens", counting)
    monkeypatch.setattr(ledger_module, "count_tokens", counting)
    trace = load(OPENHANDS[0])
    policy = CompressionConfig()
    target = round(0.3 * total(trace))
    encoded[0] = 0
    ledger = Ledger.of(trace)
    key_decision_extract(ledger, policy, _budget(target, policy))
    # Once over the input (long steps partly by sample) and once over the result.
    assert encoded[0] < 1.0 * len("\n".join(trace.text_parts()))
    assert abs(ledger.total - total(ledger.result())) < 0.02 * ledger.total


# --- the rules around the strategies ------------------------------------------------


def _synthetic(outputs: list[str], task: str = "Fix the failing build.") -> Trace:
    steps = [Step(type=StepType.MESSAGE, role="system", content="You are a coding agent.")]
    for n, output in enumerate(outputs):
        steps += [
            Step(type=StepType.THOUGHT, content=f"Step {n}: let me look at the next thing."),
            Step(type=StepType.ACTION, tool="bash", arguments={"cmd": f"run {n}"}, call_id=f"c{n}"),
            Step(type=StepType.OBSERVATION, call_id=f"c{n}", content=output),
        ]
    steps.append(Step(type=StepType.FINAL, content="The build passes now."))
    return Trace(task=task, steps=steps)


async def test_short_trace_is_skipped_with_the_reason() -> None:
    trace = _synthetic(["ok"] * 3)
    result = await compress(trace, 300, CompressionConfig())
    assert result == Skipped("ratio x total_tokens = 0.3 x 300 = 90 < min_tokens_after 500",
                             "small")


async def test_disabled_skips_unless_forced() -> None:
    trace = load(OPENHANDS[1])
    policy = CompressionConfig(enabled=False)
    assert await compress(trace, total(trace), policy) == Skipped(
        "compression disabled (compression.enabled is false)", "disabled"
    )
    result = await compressed(trace, policy, forced=True)
    assert result.tokens_after <= 1.25 * result.target and result.trace.metadata["sft_only"]


async def test_forced_under_min_is_compressed_toward_min() -> None:
    trace = _synthetic([f"line {k} of a long build log\n" * 60 for k in range(12)])
    policy = CompressionConfig(enabled=False, ratio=0.05, min_tokens_after=500)
    assert policy.ratio * total(trace) < 500
    result = await compressed(trace, policy, forced=True)
    assert result.target == 500
    assert 500 <= result.tokens_after <= 625


def test_repeated_observations_become_references_within_the_window() -> None:
    log = "\n".join(f"compiling module {k}" for k in range(120))
    later = log.replace("module 7", "module 8")  # the same but for a number: not a repeat
    ledger = Ledger.of(_synthetic([log, log, later, "x" * 10, "y" * 10, "z" * 10, log]))
    _dedup(ledger, set(), 4, Budget(aim=0, floor=0, lower=0))
    outputs = [s.content for s in ledger.result().steps if s.type is StepType.OBSERVATION]
    assert outputs[:3] == [
        log, "[output identical to the output of step 3 of the original trace]", later]
    # The last copy is 5 outputs after the previous one, beyond dedup_window.
    assert outputs[6] == log
    assert ledger.removed == {"repeated_observations": 1}


def test_an_exact_repeat_of_a_call_collapses_into_the_first_with_the_count() -> None:
    same = "Wrong flag!"
    trace = _synthetic([same, same, same, "Right flag!"])
    # The calls differ by their arguments in _synthetic; make three the same call.
    steps = list(trace.steps)
    for at in (5, 8):
        steps[at] = steps[at].model_copy(update={"arguments": steps[2].arguments})
    trace = trace.model_copy(update={"steps": steps})
    ledger = Ledger.of(trace)
    policy = CompressionConfig()
    _collapse_repeats(ledger, shape(trace, policy), 5, Budget(aim=0, floor=0, lower=0))
    out = ledger.result().steps
    calls = [s for s in out if s.type is StepType.ACTION]
    assert [c.arguments for c in calls] == [{"cmd": "run 0"}, {"cmd": "run 3"}]
    first = next(s for s in out if s.call_id == "c0" and s.type is StepType.OBSERVATION)
    assert first.content == ("Wrong flag!\n[… the same call, with the same result, was made "
                             "2 more times (steps 5, 8 of the original trace) …]")
    assert ledger.listed == {"repeated_calls": [5, 6, 8, 9], "repeat_counts": [3]}


def test_the_count_of_a_collapsed_repeat_survives_a_cut_of_its_output() -> None:
    same = "\n".join(f"curl: response line {k} without the flag" for k in range(200))
    trace = _synthetic([same, same, "Right flag!"])
    steps = list(trace.steps)
    steps[5] = steps[5].model_copy(update={"arguments": steps[2].arguments})
    trace = trace.model_copy(update={"steps": steps})
    ledger = Ledger.of(trace)
    found = shape(trace, CompressionConfig())
    _collapse_repeats(ledger, found, 5, Budget(aim=0, floor=0, lower=0))
    assert ledger.trim(3, TIGHT_KEEP, "redundant_tool_outputs", Budget(aim=0, floor=0, lower=0))
    first = ledger.result().steps[3]
    assert "tokens of output elided …]" in (first.content or "")
    assert (first.content or "").endswith(
        "\n[… the same call, with the same result, was made once more "
        "(step 5 of the original trace) …]")
    assert ledger.listed == {"repeated_calls": [5, 6], "repeat_counts": [3],
                             "redundant_tool_outputs": [3]}


async def test_reward_signal_kept_in_metadata() -> None:
    trace = load(OPENHANDS[1])
    result = await compressed(
        trace, CompressionConfig(), reward=25.0, breakdown={"task_success": 20}
    )
    metadata = result.trace.metadata
    assert (metadata["reward"], metadata["reward_breakdown"]) == (25.0, {"task_success": 20})
    assert metadata["compression"] == result.record()
    assert result.record()["ratio"] == result.ratio


def test_min_over_max_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="min_tokens_after"):
        CompressionConfig(min_tokens_after=9000, max_tokens_after=8000)


# --- summarize_middle against the fake model endpoint -------------------------------


@pytest.fixture
def fake(fake_model: FakeModel, monkeypatch: pytest.MonkeyPatch) -> FakeModel:
    monkeypatch.setenv(KEY_ENV, KEY)
    return fake_model


@pytest.fixture
async def summarizer(model_server: tuple[FakeModel, str]) -> AsyncIterator[ModelSummarizer]:
    tinker = TinkerConfig(
        base_url=f"{model_server[1]}/v1",
        api_key_env=KEY_ENV,
        model_id="fake/summarizer",
        retry=ModelRetry(max_attempts=2, base_seconds=0.001),
    )
    async with httpx.AsyncClient() as client:
        yield ModelSummarizer(client, tinker)


SUMMARIZE = CompressionConfig(strategy="summarize_middle", summary_target_tokens=200)


async def test_summarize_middle_request_and_placement(
    fake: FakeModel, summarizer: ModelSummarizer
) -> None:
    trace = load(OPENHANDS[2])
    result = await compressed(trace, SUMMARIZE, summarizer=summarizer)
    assert (result.strategy, result.fallback) == ("summarize_middle", None)
    [request] = fake.received
    assert request.path == "/v1/chat/completions"
    assert request.headers["authorization"] == f"Bearer {KEY}"
    assert request.body["model"] == "fake/summarizer"
    assert request.body["max_tokens"] == 400
    [message] = request.body["messages"]
    assert message["role"] == "user" and "TURNS TO SUMMARIZE" in message["content"]
    # Turns: 0 system, 1 first thought+action, 2 its result: the protected head.
    assert "[Turn 2 - TOOL]" not in message["content"]
    assert message["content"].split("TURNS TO SUMMARIZE:\n")[1].startswith("[Turn 3 - GPT]:")

    steps = result.trace.steps
    [at] = [i for i, s in enumerate(steps) if s.content and s.content.startswith(PREFIX)]
    assert steps[at].type is StepType.MESSAGE and steps[at].role == "user"
    # Head: system, first thought+action, first result; all before the summary, unchanged.
    assert steps[:at] == trace.steps[:at] and at >= 4
    assert result.removed["summarized_steps"] > 0
    assert result.tokens_after <= 1.25 * result.target


@pytest.mark.parametrize("path", OPENHANDS, ids=_ids(OPENHANDS))
async def test_summarize_middle_never_splits_a_call_from_its_result(
    fake: FakeModel, summarizer: ModelSummarizer, path: Path
) -> None:
    trace = load(path)
    result = await compressed(trace, SUMMARIZE, summarizer=summarizer)
    assert result.fallback is None
    calls = {s.call_id for s in result.trace.steps if s.type is StepType.ACTION}
    answered = {
        s.call_id for s in result.trace.steps if s.type is StepType.OBSERVATION and s.call_id
    }
    assert answered <= calls
    # Every call whose result was in the original still has it next to it.
    had_result = {s.call_id for s in trace.steps if s.type is StepType.OBSERVATION}
    assert calls & had_result <= answered


def test_span_snaps_around_tool_turns() -> None:
    steps = [Step(type=StepType.MESSAGE, role="system", content="You are a coding agent.")]
    for n in range(4):
        steps += [
            Step(type=StepType.ACTION, tool="bash", arguments={"cmd": f"run {n}"}, call_id=f"c{n}"),
            Step(type=StepType.OBSERVATION, call_id=f"c{n}", content=f"output {n}"),
        ]
    ledger = Ledger.of(Trace(task="Fix the build.", steps=steps))
    ledger.tokens[:] = [10] * len(steps)
    turns = _turns(steps)
    assert [t.role for t in turns] == ["system", *["gpt", "tool"] * 4]
    policy = CompressionConfig(protect_last_n_turns=3)  # the tail starts on a tool turn
    # Need 10: one gpt turn, and its tool turn goes with it.
    assert _span(turns, ledger, 10, policy) == (3, 5)
    # Need everything: the tail's tool turn (7) belongs to gpt turn 6, so 6 stays out.
    assert _span(turns, ledger, 1000, policy) == (3, 5)


def test_summary_never_meets_a_user_turn_nor_splits_a_question() -> None:
    """A conversation (tau-bench's shape): the summary, a user turn, goes only between
    an assistant turn and the next assistant turn, and takes questions with answers."""
    said = [("system", "policy")]
    for n in range(5):
        said += [("assistant", f"question {n}?"), ("user", f"answer {n}")]
    steps = [Step(type=StepType.MESSAGE, role=role, content=text) for role, text in said]
    steps.insert(3, Step(type=StepType.ACTION, tool="lookup", call_id="k", arguments={}))
    steps.insert(4, Step(type=StepType.OBSERVATION, call_id="k", content="found"))
    # system, q0, a0, call, result, q1, a1, q2, a2, q3, a3, q4, a4
    ledger = Ledger.of(Trace(task="Book a flight.", steps=steps))
    policy = CompressionConfig(protect_last_n_turns=2)
    # Wanted: q1 alone; taken: q1 with its answer, after the call's result.
    assert _span(_turns(steps), ledger, 1, policy) == (5, 7)
    assert not ledger.can_replace(1, 3)  # would follow the task: two user turns
    assert not ledger.can_replace(6, 8)  # would take a1 from its question q1
    assert not ledger.can_replace(4, 7)  # would take the result from its call


@pytest.mark.parametrize(
    ("fault", "said"),
    [("500", "unavailable after 2"), ("401", KEY_ENV), ("no_choices", "fake/summarizer")],
)
async def test_summarize_middle_falls_back_when_the_model_fails(
    fake: FakeModel, summarizer: ModelSummarizer, fault: str, said: str
) -> None:
    fake.faults.extend([fault] * 3)
    trace = load(OPENHANDS[2])
    result = await compressed(trace, SUMMARIZE, summarizer=summarizer)
    assert result.strategy == "key_decision_extract"
    assert (
        result.fallback
        and result.fallback.startswith("the summary model failed")
        and said in result.fallback
    )
    assert KEY not in result.fallback
    assert result.trace.metadata["compression"]["fallback"] == result.fallback
    assert not any((s.content or "").startswith(PREFIX) for s in result.trace.steps)
    assert result.tokens_after <= 1.25 * result.target


async def test_summarize_middle_without_a_summarizer_falls_back() -> None:
    result = await compressed(load(OPENHANDS[2]), SUMMARIZE)
    assert result.strategy == "key_decision_extract" and "no summarizer" in (result.fallback or "")


async def test_a_conversation_without_a_place_for_a_summary_falls_back_quickly() -> None:
    """A pure question-and-answer chat has no span a summary (a user turn) may replace:
    summarize_middle says so, in one pass over the turns, and key_decision_extract
    takes over (it drops questions with their answers)."""
    steps = [Step(type=StepType.MESSAGE, role="system", content="policy")]
    for n in range(400):
        steps += [Step(type=StepType.MESSAGE, role="assistant", content=f"question {n} " * 20),
                  Step(type=StepType.MESSAGE, role="user", content=f"answer {n} " * 20)]
    trace = Trace(task="Help me.", steps=steps)
    result = await compress(trace, total(trace), SUMMARIZE, summarizer=_Unused())
    # key_decision_extract takes over, and keeps every turn of a dialogue: nothing to
    # save, so the trace is kept whole.
    assert isinstance(result, Skipped) and result.kind == "min_saving", result


@pytest.mark.parametrize("summary", ["", "   ", PREFIX, "garbage " * 60_000])
async def test_an_empty_or_growing_summary_is_a_model_failure(
    fake: FakeModel, summarizer: ModelSummarizer, summary: str
) -> None:
    fake.reply = lambda body: summary
    trace = load(OPENHANDS[2])
    # on_model_failure: retry (the caller's fall_back false): the failure is raised, for
    # the stage to retry and then leave the trace compression_failed.
    with pytest.raises(LLMError, match="empty summary|makes the trace no shorter"):
        await compress(trace, total(trace), SUMMARIZE, summarizer=summarizer, fall_back=False)
    # on_model_failure: fallback, after the last attempt: key_decision_extract, said.
    result = await compressed(trace, SUMMARIZE, summarizer=summarizer)
    assert (result.strategy, result.model_failed) == ("key_decision_extract", True)
    assert result.fallback and result.fallback.startswith("the summary model failed")
    assert result.tokens_after < result.tokens_before
    assert not any((s.content or "").startswith(PREFIX) for s in result.trace.steps)


class _Unused:
    async def __call__(self, prompt: str, *, max_tokens: int) -> str:
        raise AssertionError("no span, so no summary is asked for")
