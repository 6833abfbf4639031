"""Compression keeps conversations valid: every strategy, on every trace of the real
corpus (../shared/fixtures/real, read through app/import_sources), keeps the
invariants of app.compression.invariants; and the checker itself finds each fault."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator

import httpx
import pytest

from app.compression import Compressed, ModelSummarizer, Skipped, compress, extract
from app.compression.invariants import (
    CALL_WITHOUT_RESULT,
    EMPTY_ASSISTANT_TURN,
    RESULT_WITHOUT_CALL,
    TWO_USER_TURNS,
    conversation_faults,
    violations,
)
from app.compression.ledger import Ledger
from app.config import CompressionConfig, ModelRetry, TinkerConfig
from app.domain import Step, StepType, Trace
from app.import_sources import Parsed, read_path
from app.tokens import count_parts
from tests.support import REAL
from tests.support.fakes.model_server import FakeModel

KEY_ENV = "FAKE_SUMMARY_KEY"
DEFAULT = CompressionConfig()
# Tighter than the defaults, so that many more of the corpus' traces are compressed,
# and harder: the passes that remove whole steps run on most of them.
TIGHT = CompressionConfig(ratio=0.1, min_tokens_after=200, max_tokens_after=4000)
EXTRACT = {"default": DEFAULT, "tight": TIGHT}
SUMMARIZE = {
    "default": CompressionConfig(strategy="summarize_middle"),
    "tight": TIGHT.model_copy(update={"strategy": "summarize_middle",
                                      "summary_target_tokens": 100}),
}


@pytest.fixture(scope="module")
def corpus() -> list[tuple[str, Trace]]:
    records = [r for r in read_path(REAL) if isinstance(r, Parsed)]
    assert len(records) > 800  # the whole corpus, not a corner of it
    return [(r.location, r.trace) for r in records]


@pytest.fixture
async def summarizer(
    fake_model: FakeModel, model_root: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[ModelSummarizer]:
    monkeypatch.setenv(KEY_ENV, FakeModel.key)
    tinker = TinkerConfig(base_url=f"{model_root}/v1", api_key_env=KEY_ENV,
                          model_id="fake/summarizer", retry=ModelRetry(max_attempts=1))
    async with httpx.AsyncClient() as client:
        yield ModelSummarizer(client, tinker)


async def _compress_all(
    corpus: list[tuple[str, Trace]], policy: CompressionConfig,
    summarizer: ModelSummarizer | None = None,
) -> tuple[list[Compressed], dict[str, list[str]]]:
    done: list[Compressed] = []
    broken: dict[str, list[str]] = {}
    for location, trace in corpus:
        result = await compress(trace, count_parts(trace.text_parts()), policy,
                                summarizer=summarizer)
        if isinstance(result, Skipped):
            assert "would break" not in result.reason, (location, result.reason)
            continue
        done.append(result)
        if faults := violations(trace, result.trace, policy):
            broken[location] = faults
    return done, broken


@pytest.mark.corpus
@pytest.mark.parametrize("policy", EXTRACT.values(), ids=EXTRACT.keys())
async def test_key_decision_extract_keeps_every_invariant_on_the_real_corpus(
    corpus: list[tuple[str, Trace]], policy: CompressionConfig
) -> None:
    done, broken = await _compress_all(corpus, policy)
    assert broken == {}
    assert len(done) >= 150
    removed = Counter(kind for result in done for kind in result.removed)
    # Each pass ran somewhere, so each was checked.
    assert removed["intermediate_thoughts"] > 20 and removed["redundant_tool_outputs"] > 20
    assert removed["repeated_calls"] > 0 and removed["repeat_counts"] > 0


@pytest.mark.corpus
@pytest.mark.parametrize("policy", SUMMARIZE.values(), ids=SUMMARIZE.keys())
async def test_summarize_middle_keeps_every_invariant_on_the_real_corpus(
    corpus: list[tuple[str, Trace]], policy: CompressionConfig, summarizer: ModelSummarizer
) -> None:
    done, broken = await _compress_all(corpus, policy, summarizer)
    assert broken == {}
    summarized = [r for r in done if r.strategy == "summarize_middle"]
    assert len(summarized) >= 100
    tau = [r for r in summarized if r.trace.source_format == "tau_bench"]
    assert tau  # conversations with a user, not only tool loops


async def test_the_tau_bench_conversation_stays_a_conversation(
    corpus: list[tuple[str, Trace]],
) -> None:
    """The issue's case: the system policy, every question with its answer, and the
    ratio reached recorded when the invariants stop short of the target."""
    tau = [trace for location, trace in corpus if "tau-bench" in location]
    result = await compress(tau[0], count_parts(tau[0].text_parts()), DEFAULT)
    assert isinstance(result, Compressed)
    system = [s for s in result.trace.steps if s.role == "system"]
    assert [s.content for s in system] == [tau[0].steps[0].content]
    assert len(system[0].content or "") == 6155
    record = result.trace.metadata["compression"]
    assert record["ratio"] == round(result.tokens_after / result.tokens_before, 4)
    assert record["tokens_after"] > record["target"]  # the prompt alone is over it
    assert set(record["removed_steps"]) == set(record["removed"])


async def test_the_guard_keeps_the_trace_whole_when_a_strategy_breaks_it(
    corpus: list[tuple[str, Trace]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass that drops what it may not (here: thoughts and user turns alike, without
    the ledger's conversation check) is caught: compress() keeps those traces whole
    instead of returning them broken."""
    def drop_messages_too(ledger: Ledger, protected: set[int], budget: object) -> None:
        for i, step in enumerate(ledger.steps):
            if step is not None and step.type in (StepType.THOUGHT, StepType.MESSAGE) \
                    and step.role != "system" and i not in protected:
                ledger._set(i, None, 0)
                ledger._note("intermediate_thoughts", i)

    monkeypatch.setattr(extract, "_drop_thoughts", drop_messages_too)
    kept_whole = []
    for _, trace in corpus:
        result = await compress(trace, count_parts(trace.text_parts()), TIGHT)
        if isinstance(result, Skipped) and "would break" in result.reason:
            assert result.kind == "unsafe"
            kept_whole.append(result.reason)
    assert len(kept_whole) >= 3
    assert any("(message) changed as intermediate_thoughts" in r for r in kept_whole)


# --- the checker, fault by fault ------------------------------------------------------


def _msg(role: str, text: str) -> Step:
    return Step(type=StepType.MESSAGE, role=role, content=text)


def test_conversation_faults_name_each_kind() -> None:
    call = Step(type=StepType.ACTION, tool="ls", call_id="a", arguments={})
    result = Step(type=StepType.OBSERVATION, call_id="a", content="x")
    stray = Step(type=StepType.OBSERVATION, call_id="zz", content="y")
    ok = Trace(task="t", steps=[call, result, _msg("assistant", "done")])
    assert conversation_faults(ok) == []
    kinds = [kind for kind, _ in conversation_faults(
        Trace(task="t", steps=[_msg("user", "again"), call, _msg("user", "hm"), stray])
    )]
    # The stray result opens an assistant turn of its own, with nothing said in it.
    assert kinds == [TWO_USER_TURNS, CALL_WITHOUT_RESULT, EMPTY_ASSISTANT_TURN,
                     RESULT_WITHOUT_CALL]


def _record(trace: Trace, removed_steps: dict[str, list[int]]) -> Trace:
    record = {"removed": {k: len(v) for k, v in removed_steps.items()},
              "removed_steps": removed_steps}
    return trace.model_copy(update={"metadata": {"compression": record}})


def test_violations_catch_what_the_issue_saw() -> None:
    steps = [_msg("system", "policy " * 50), _msg("assistant", "Your user id?"),
             _msg("user", "mia_3668"), Step(type=StepType.ACTION, tool="get", call_id="c"),
             Step(type=StepType.OBSERVATION, call_id="c", content="{...}"),
             _msg("assistant", "Booked.")]
    original = Trace(task="Book a flight.", steps=steps)
    same = _record(original, {})
    assert violations(original, same, DEFAULT) == []

    # The question dropped, its answer kept: two user turns (task, answer) and a split pair.
    no_question = _record(original.model_copy(update={"steps": [steps[0], *steps[2:]]}),
                          {"intermediate_thoughts": [1]})
    found = violations(original, no_question, DEFAULT)
    assert any(TWO_USER_TURNS in f for f in found)
    assert any("a question and its answer" in f for f in found)
    assert "step 1 (message) changed as intermediate_thoughts" in found

    cut = steps[0].model_copy(update={"content": "policy [… 40 tokens of output elided …]"})
    short_system = _record(original.model_copy(update={"steps": [cut, *steps[1:]]}),
                           {"redundant_tool_outputs": [0]})
    assert violations(original, short_system, DEFAULT) == [
        "the system prompt changed", "step 0 (message) changed as redundant_tool_outputs"]

    # The issue's case: a call and its result gone, as if exploration.
    no_call = _record(original.model_copy(update={"steps": steps[:3] + steps[5:]}),
                      {"intermediate_thoughts": [3, 4]})
    assert violations(original, no_call, DEFAULT) == [
        "step 3 (action) changed as intermediate_thoughts",
        "step 4 (observation) changed as intermediate_thoughts"]

    unlisted = _record(original.model_copy(update={"steps": steps[:3] + steps[5:]}), {})
    assert any("the record lists 0 removed" in f for f in violations(original, unlisted, DEFAULT))

    answer = steps[5].model_copy(update={"content": "Book"})
    changed = _record(original.model_copy(update={"steps": [*steps[:5], answer]}),
                      {"redundant_tool_outputs": [5]})
    assert violations(original, changed, DEFAULT)[0] == "the final answer changed"

    user = steps[2].model_copy(update={"content": "mia"})
    altered = _record(original.model_copy(update={"steps": [*steps[:2], user, *steps[3:]]}),
                      {"redundant_tool_outputs": [2]})
    assert violations(original, altered, DEFAULT) == [
        "step 2 (message) changed as redundant_tool_outputs"]

