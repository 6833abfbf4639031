"""Compression that training can trust, on the whole real corpus with the repo's example
configs (compression.json.example, config.json.example): every tool call with its
result and every user turn kept, the facts an assistant states still backed by what
came before, and a saving worth the copy (tests/support/compression_quality.py)."""

from __future__ import annotations

import asyncio

import pytest

from app.compression import Compressed, Skipped, compress
from app.compression.ledger import is_system
from app.domain import StepType
from app.tokens import count_parts
from tests.support import compression_quality as quality
from tests.support.real_traces import SWE_AGENT, load


@pytest.fixture(scope="module")
def figures() -> quality.Figures:
    traces = quality.corpus()
    assert len(traces) > 800  # the whole corpus, not a corner of it
    return asyncio.run(quality.measure(traces))


@pytest.mark.corpus
def test_no_compressed_trace_loses_its_tool_calls(figures: quality.Figures) -> None:
    assert len(figures.checks) > 100
    lost = [c.location for c in figures.checks if c.lost_every_call]
    assert lost == []
    assert figures.summary()["distinct_calls_kept"] >= 0.99


@pytest.mark.corpus
def test_every_user_turn_survives(figures: quality.Figures) -> None:
    lost = [(c.location, c.users - c.users_kept) for c in figures.checks
            if c.strategy == "key_decision_extract" and c.users_kept < c.users]
    assert lost == []


@pytest.mark.corpus
def test_backed_facts_stay_backed(figures: quality.Figures) -> None:
    assert sum(c.facts for c in figures.checks) > 1000
    assert figures.summary()["facts_still_backed"] >= 0.99


@pytest.mark.corpus
def test_what_is_compressed_saves_enough(figures: quality.Figures) -> None:
    policy, _ = quality.example_policy()
    assert policy.min_saving == 0.1
    under = [(c.location, round(c.saving, 3)) for c in figures.checks if c.saving < 0.1]
    assert under == []
    # Traces that compression cannot shrink by a tenth are kept whole, and said so.
    assert figures.skipped.get("min_saving", 0) > 0
    assert figures.summary()["tokens_saved"] >= 0.35


@pytest.mark.corpus
async def test_system_prompts_and_the_last_thought_are_untouched_and_outputs_elided_visibly(
) -> None:
    policy, max_trace_tokens = quality.example_policy()
    marked = dropped = 0
    for location, trace in quality.corpus():
        total = count_parts(trace.text_parts())
        result = await compress(trace, total, policy, forced=total > max_trace_tokens)
        if isinstance(result, Skipped):
            continue
        out = result.trace
        assert [s for s in out.steps if is_system(s)] == [
            s for s in trace.steps if is_system(s)], location
        # Thoughts may go, but for the reasoning that led to the answer.
        thoughts = [s for s in trace.steps if s.type is StepType.THOUGHT]
        assert not thoughts or thoughts[-1] in out.steps, location
        dropped += len(thoughts) - sum(1 for s in out.steps if s.type is StepType.THOUGHT)
        for step in out.steps:
            if step.type is StepType.OBSERVATION and step not in trace.steps:
                assert "tokens of output elided …]" in (step.content or "") or (
                    "[output identical to the output of step" in (step.content or "")
                ) or "the same call, with the same result" in (step.content or ""), location
                marked += 1
    assert marked > 500 and dropped > 100


async def test_the_long_ctf_run_still_compresses_threefold() -> None:
    [path] = [p for p in SWE_AGENT if p.name == "ctf_web_i_got_id_demo.traj"]
    trace = load(path)
    policy, _ = quality.example_policy()
    total = count_parts(trace.text_parts())
    result = await compress(trace, total, policy)
    assert isinstance(result, Compressed)
    assert total >= 3 * result.tokens_after
    assert 800 <= result.tokens_after <= 6000
    check = quality.check(path.name, trace, result)
    assert check.distinct_kept == check.distinct_calls and check.calls_after > 0
