"""The native format (app/formats/native.py): every step kind, and its errors."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from app import formats
from app.config import LimitsConfig
from app.domain import Status, StepType, Trace
from app.errors import Invalid
from app.ingest.ingestor import Preparer
from tests.support.format_examples import (
    ENVIRONMENT,
    NATIVE,
)

# --- native -------------------------------------------------------------------------


def test_native_parses_every_step_kind() -> None:
    trace = formats.parse(NATIVE)
    assert trace.trace_id == "native-0001"
    assert trace.agent.model == "qwen3-8b" and trace.env == "swe-lite"
    assert trace.tools == ["bash", "edit_file"]
    assert trace.outcome.status is Status.SUCCESS and trace.outcome.code_runs_ok is True
    obs = [s for s in trace.steps if s.type is StepType.OBSERVATION]
    assert [o.error for o in obs] == [None, "old text not found", "error", None, None]
    assert [o.exit_code for o in obs] == [1, None, None, 0, 0]
    assert trace.steps[6].arguments == "{path: dates.py"  # kept as the agent wrote it
    assert trace.steps[10].role == "assistant" and trace.steps[12].content == "Will do."
    Trace.model_validate(trace.model_dump())


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"task": None}, "task", "missing"),
        ({"task": "  "}, "task", "empty"),
        ({"task": 7}, "task", "string"),
        ({"steps": {"type": "thought"}}, "steps", "array"),
        ({"trace_id": 12}, "trace_id", "string"),
        ({"outcom": {}}, "outcom", "unknown key"),
        ({"outcome": {"status": "great"}}, "outcome.status", "success, failure, timeout"),
        ({"agent": "me"}, "agent", "object"),
        ({"metadata": []}, "metadata", "object"),
    ],
)
def test_native_top_level_errors(change: dict[str, Any], field: str, words: str) -> None:
    item = {**NATIVE, **change}
    item = {k: v for k, v in item.items() if v is not None}
    with pytest.raises(Invalid) as err:
        formats.parse(item)
    assert err.value.field == field
    assert words in err.value.message
    assert err.value.status == 422


@pytest.mark.parametrize(
    ("step", "field", "words"),
    [
        ({"type": "dance"}, "steps[3].type", "thought, action, observation, message, final"),
        ({"content": "x"}, "steps[3].type", "required"),
        ({"type": 5}, "steps[3].type", "unknown step type"),
        ({"type": "action", "arguments": {}}, "steps[3].tool", "missing"),
        ({"type": "observation", "exit_code": "1"}, "steps[3].exit_code", "integer"),
        ({"type": "observation", "exit_code": True}, "steps[3].exit_code", "integer"),
        ({"type": "observation", "error": 1}, "steps[3].error", "boolean"),
        ({"type": "message", "role": "robot"}, "steps[3].role", "system, user, assistant"),
        ({"type": "thought", "content": ["a"]}, "steps[3].content", "string"),
        ({"type": "thought", "mood": "good"}, "steps[3].mood", "unknown key"),
    ],
)
def test_native_step_errors(step: dict[str, Any], field: str, words: str) -> None:
    item = copy.deepcopy(NATIVE)
    item["steps"][3] = step
    with pytest.raises(Invalid) as err:
        formats.parse(item)
    assert err.value.field == field
    assert words in err.value.message


def test_native_observation_content_may_be_json() -> None:
    item = {"task": "t", "steps": [{"type": "observation", "content": {"rows": 3}}]}
    assert formats.parse(item).steps[0].content == '{"rows":3}'


def test_too_deep_json_is_invalid_not_a_crash() -> None:
    deep: Any = {}
    for _ in range(300):
        deep = {"a": deep}
    item = {"task": "t", "steps": [{"type": "action", "tool": "x", "arguments": deep}]}
    with pytest.raises(Invalid) as err:
        formats.parse(item)
    assert err.value.field == "steps[0].arguments"


def test_arguments_sent_as_text_that_nest_too_deep_to_store_are_refused() -> None:
    """A tool call's arguments sent as a JSON string are parsed, and
    limits.max_json_depth bounds the item as sent, not what its strings hold: nested
    past what JSON can be written with (254 levels, the trace around them included),
    they are refused (422), not a crash."""
    for depth in (251, 253, 300):
        arguments = '{"a":' + "[" * depth + "]" * depth + "}"
        item = {"task": "t", "steps": [{"type": "action", "tool": "x", "arguments": arguments}]}
        with pytest.raises(Invalid, match="cannot be stored as JSON"):
            Preparer(ENVIRONMENT, LimitsConfig()).row(item)
