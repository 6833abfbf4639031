"""Which runs become DPO pairs: runs of one task (its `task_id` where one is known, as
OTLP's `atropos.task_id`), of one agent unless asked, never a run without a task."""

from __future__ import annotations

from app.domain import Trace
from app.formats import dataset
from app.formats.otlp import parse
from tests.support.captures import document, spans


def _runs(**agents: str | None) -> list[dataset.Attempt]:
    return [dataset.Attempt(f"r-{i}", "task", reward, agent)
            for i, (reward, agent) in enumerate(zip((9.0, 0.0), agents.values(), strict=True))]


def test_runs_of_different_agents_pair_only_when_asked() -> None:
    runs = _runs(a="solver", b="baseline")
    assert dataset.preference_pairs(runs, 1.0, 1) == []
    assert dataset.preference_pairs(runs, 1.0, 1, across_agents=True) == [(runs[0], runs[1])]
    same = _runs(a="solver", b="solver")
    assert dataset.preference_pairs(same, 1.0, 1) == [(same[0], same[1])]


def test_a_run_without_a_task_is_never_paired() -> None:
    assert not dataset.pairable(Trace(task="", steps=[]))
    assert not dataset.pairable(Trace(task="   "))
    assert dataset.pairable(Trace(task="What is the weather in Paris?"))


def test_otlp_runs_of_one_task_id_share_a_task_phrased_differently() -> None:
    keys = []
    for scenario, phrase in (("basic", None), ("tool_error", None)):
        captured = spans("openai-v2", scenario)
        for s in captured:
            if not s["parent_span_id"]:
                s["attributes"] = {**s["attributes"], "atropos.task_id": "weather-7"}
        trace = parse(document(captured))
        assert trace.metadata["task_id"] == "weather-7", phrase
        keys.append(dataset.task_key(trace))
    # "... in Paris?" and "... in Atlantis?": one task by its id.
    assert keys[0] == keys[1]
