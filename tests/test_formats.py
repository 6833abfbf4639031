"""What /v1/traces accepts, across formats: detection and dispatch, the environment's
reward wherever an agent puts it, and round trips through every export. Each format
has its own file: test_formats_native.py, _openai, _sharegpt, _atif; hostile input
is test_formats_hostile.py."""

from __future__ import annotations

from typing import Any

import pytest

from app import formats
from app.domain import Status
from app.errors import Invalid, UnknownFormat
from tests.support.format_examples import (
    BATCH_RUNNER,
    EXAMPLES,
    EXPORT_OF,
    HERMES,
    NATIVE,
    OPENAI,
    assert_atif,
    assert_fine_tuning_record,
)

# --- detection and dispatch ---------------------------------------------------------


@pytest.mark.parametrize("name", EXAMPLES)
def test_detect_finds_each_format(name: str) -> None:
    assert formats.detect(EXAMPLES[name]) == name
    assert formats.parse(EXAMPLES[name]).source_format == name


def test_detect_names_what_it_looked_for() -> None:
    with pytest.raises(UnknownFormat) as err:
        formats.detect({"foo": 1})
    for key in ("schema_version", "messages", "conversations", "steps", '"format"'):
        assert key in err.value.message


def test_format_key_and_argument_choose_the_parser() -> None:
    item = {**HERMES, "format": "hermes"}
    assert formats.parse(item).source_format == "sharegpt"
    # The item's own key wins over a request-wide choice.
    assert formats.parse(item, "openai").source_format == "sharegpt"
    with pytest.raises(Invalid) as err:
        formats.parse({"messages": []}, "native")
    assert err.value.field == "messages"


@pytest.mark.parametrize("item", [{**NATIVE, "format": "xml"}, {**NATIVE, "format": 3}])
def test_unknown_format_name(item: dict[str, Any]) -> None:
    with pytest.raises(UnknownFormat) as err:
        formats.parse(item)
    assert err.value.field == "format"
    assert err.value.status == 422
    with pytest.raises(UnknownFormat):
        formats.parse(NATIVE, "yaml")
    with pytest.raises(UnknownFormat) as export_err:
        formats.export(formats.parse(NATIVE), "csv")
    assert export_err.value.field == "format"


@pytest.mark.parametrize("item", [[NATIVE], "trace", 3, None])
def test_item_must_be_an_object(item: Any) -> None:
    with pytest.raises(Invalid) as err:
        formats.parse(item)
    assert "JSON object" in err.value.message


# --- the environment's reward ---------------------------------------------------------

_CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
_TURNS = [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4"}]
_ATIF_STEPS = [{"step_id": 1, "source": "user", "message": "What is 2+2?"},
               {"step_id": 2, "source": "agent", "message": "4"}]


@pytest.mark.parametrize(
    "item",
    [
        {"task": "2+2?", "steps": [], "outcome": {"reward": 0.01}},
        {"task": "2+2?", "steps": [], "reward": 0.01},
        {"format": "openai", "messages": _CHAT, "reward": 0.01},
        {"messages": _CHAT, "outcome": {"reward": 0.01}},
        {"conversations": _TURNS, "reward": 0.01},
        {"schema_version": "ATIF-v1.4", "steps": _ATIF_STEPS, "reward": 0.01},
        {"schema_version": "ATIF-v1.4", "steps": _ATIF_STEPS,
         "final_metrics": {"total_steps": 2, "extra": {"reward": 0.01}}},
        {"schema_version": "ATIF-v1.4", "steps": _ATIF_STEPS, "final_metrics": {"reward": 0.01}},
    ],
    ids=["native-outcome", "native-top", "openai", "openai-outcome", "sharegpt", "atif-top",
         "atif-final-metrics-extra", "atif-final-metrics"],
)
def test_env_reward_is_read_where_agents_put_it_and_makes_no_status(item: dict[str, Any]) -> None:
    trace = formats.parse(item)
    assert trace.outcome.reward == 0.01
    assert trace.outcome.status is Status.UNKNOWN


def test_a_reported_status_stays_beside_the_env_reward() -> None:
    trace = formats.parse({"messages": _CHAT, "reward": 0.0, "status": "success"})
    assert (trace.outcome.status, trace.outcome.reward) == (Status.SUCCESS, 0.0)
    hermes = formats.parse({"conversations": _TURNS, "completed": False, "reward": 1})
    assert (hermes.outcome.status, hermes.outcome.reward) == (Status.FAILURE, 1.0)


@pytest.mark.parametrize(
    ("item", "field", "words"),
    [
        ({"messages": _CHAT, "reward": True}, "reward", "expected a number"),
        ({"messages": _CHAT, "reward": "0.5"}, "reward", "expected a number"),
        ({"messages": _CHAT, "reward": float("inf")}, "reward", "finite"),
        ({"task": "t", "steps": [], "outcome": {"reward": float("nan")}}, "outcome.reward",
         "finite"),
        ({"task": "t", "steps": [], "outcome": {"reward": 1}, "reward": 2}, "reward",
         "differs from outcome.reward"),
        ({"schema_version": "ATIF-v1.4", "steps": _ATIF_STEPS, "reward": 1,
          "final_metrics": {"extra": {"reward": 0}}}, "final_metrics.extra.reward", "differs"),
    ],
)
def test_bad_env_rewards_are_refused_naming_the_field(
    item: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(Invalid) as err:
        formats.parse(item)
    assert err.value.field == field and words in err.value.message


def test_the_same_env_reward_in_two_places_is_one_reward() -> None:
    trace = formats.parse({"task": "t", "steps": [], "outcome": {"reward": 1}, "reward": 1.0})
    assert trace.outcome.reward == 1.0


@pytest.mark.parametrize("target", ["native", "atif", "sharegpt", "hermes"])
def test_exports_keep_the_env_reward(target: str) -> None:
    trace = formats.parse({**OPENAI, "reward": 0.25})
    again = formats.parse(formats.export(trace, target), "hermes" if target == "hermes" else None)
    assert again.outcome.reward == 0.25


def test_atif_export_puts_the_env_reward_in_final_metrics() -> None:
    doc = formats.export(formats.parse({"messages": _CHAT, "reward": 0.5}), "atif")
    assert doc["final_metrics"] == {"extra": {"reward": 0.5}}
    assert_atif(doc)


def test_openai_export_stays_a_fine_tuning_record_with_an_env_reward() -> None:
    # Fine-tuning APIs validate these records: the reward goes beside them, not in.
    record = formats.export(formats.parse({**OPENAI, "reward": 0.25}), "openai")
    assert_fine_tuning_record(record)


# --- round trips ----------------------------------------------------------------------


@pytest.mark.parametrize("name", EXAMPLES)
def test_round_trip_in_own_format(name: str) -> None:
    trace = formats.parse(EXAMPLES[name])
    exported = formats.export(trace, EXPORT_OF[name])
    again = formats.parse(exported, name)
    assert again.steps == trace.steps
    assert again.task == trace.task
    assert again.tools == trace.tools
    if name != "openai":  # a fine-tuning record has no outcome
        assert again.outcome.status == trace.outcome.status


def test_native_round_trip_is_exact() -> None:
    trace = formats.parse(NATIVE)
    assert formats.parse(formats.export(trace, "native")) == trace


@pytest.mark.parametrize("name", EXAMPLES)
@pytest.mark.parametrize("target", ["native", "atif", "hermes"])
def test_lossless_exports_keep_steps_from_any_format(name: str, target: str) -> None:
    trace = formats.parse(EXAMPLES[name])
    again = formats.parse(formats.export(trace, target), "hermes" if target == "hermes" else None)
    assert again.steps == trace.steps
    assert again.task == trace.task


def test_batch_runner_round_trips_through_hermes() -> None:
    trace = formats.parse(BATCH_RUNNER)
    again = formats.parse(formats.export(trace, "hermes"))
    assert again.steps == trace.steps and again.outcome.status is Status.FAILURE
