"""The sharegpt format and Hermes' trajectories (app/formats/sharegpt.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app import formats
from app.domain import Status
from app.errors import Invalid
from tests.support.format_examples import (
    BATCH_RUNNER,
    HERMES,
    HERMES_LINE,
    NATIVE,
    kinds,
)

# --- sharegpt / hermes --------------------------------------------------------------


def test_real_hermes_line() -> None:
    line = HERMES_LINE.read_text(encoding="utf-8").splitlines()[0]
    item = json.loads(line)
    trace = formats.parse(item)
    assert trace.source_format == "sharegpt"
    assert trace.outcome.status is Status.SUCCESS
    assert trace.agent.model == "nvidia/nemotron-3-ultra-550b-a55b"
    assert trace.tools is not None and len(trace.tools) == 32
    assert {"terminal", "read_file", "browser_click"} <= set(trace.tools)
    assert trace.task.startswith("respond only with: Hello!")
    assert kinds(trace) == ["thought", "final"]
    assert trace.steps[1].content == "Hello! I am Lucifex Agent. How can I help you today?"
    # Hermes export writes the same conversation back, system prompt included.
    assert formats.export(trace, "hermes")["conversations"] == item["conversations"]


def test_hermes_calls_results_and_errors() -> None:
    trace = formats.parse(HERMES)
    assert trace.tools == ["terminal", "read_file"]
    assert (
        trace.outcome.status is Status.SUCCESS and trace.agent.model == "example-org/example-model"
    )
    assert kinds(trace) == [
        "thought",
        "action",
        "action",
        "observation",
        "observation",
        "action",
        "observation",
        "final",
    ]
    call, failed = trace.steps[1], trace.steps[4]
    assert call.call_id == "call_a1" and call.arguments == {"command": "wc -l notes.txt"}
    assert trace.steps[3].exit_code == 0 and trace.steps[3].error is None
    assert failed.call_id == "call_a2" and failed.error == "permission denied"
    assert trace.steps[5].content == "Reading failed; try cat."
    assert trace.metadata["timestamp"] == HERMES["timestamp"]
    assert trace.metadata["tool_schemas"][0]["function"]["name"] == "terminal"


def test_batch_runner_line() -> None:
    trace = formats.parse(BATCH_RUNNER)
    assert trace.outcome.status is Status.FAILURE and trace.outcome.reason == "partial"
    assert trace.agent.model == "claude-opus-4-20250514"
    assert trace.metadata["prompt_index"] == 7 and trace.metadata["api_calls"] == 4
    assert trace.metadata["tool_error_counts"] == {"terminal": 0, "read_file": 1}
    assert trace.metadata["batch_num"] == 1


def test_sharegpt_bad_tool_call_and_response_variants() -> None:
    trace = formats.parse(
        {
            "conversations": [
                {"from": "user", "value": "go"},
                {
                    "from": "assistant",
                    "value": "<tool_call>\n{'name': 'terminal', 'arguments': {}}\n</tool_call>",
                },
                {
                    "from": "observation",
                    "value": '<tool_response>\n{"content": "ok", "error": "boom", "exit_code": 2}\n</tool_response>',
                },
                {
                    "from": "gpt",
                    "value": '<tool_call>{"name": "t", "arguments": "{\\"a\\": 1}"}</tool_call>',
                },
                {"from": "function", "value": "Error: nope"},
                {"from": "human", "value": "thanks"},
            ]
        }
    )
    assert kinds(trace) == ["action", "observation", "action", "observation", "message"]
    assert trace.steps[0].tool == "terminal" and isinstance(trace.steps[0].arguments, str)
    assert trace.steps[1].error == "boom" and trace.steps[1].exit_code == 2
    assert trace.steps[2].arguments == {"a": 1}
    assert trace.steps[3].error == "Error: nope"
    assert trace.outcome.status is Status.UNKNOWN


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"conversations": "x"}, "conversations"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "conversations[0].from"),
        ({"conversations": [{"value": "x"}]}, "conversations[0].from"),
        ({"conversations": [{"from": "gpt", "value": 3}]}, "conversations[0].value"),
        ({"completed": "yes"}, "completed"),
        ({"model": 3}, "model"),
    ],
)
def test_sharegpt_errors(change: dict[str, Any], field: str) -> None:
    with pytest.raises(Invalid) as err:
        formats.parse({**HERMES, **change})
    assert err.value.field == field


def test_plain_sharegpt_export_has_no_hermes_envelope() -> None:
    plain = formats.export(formats.parse(HERMES), "sharegpt")
    assert list(plain) == ["conversations"]
    assert plain["conversations"][0]["from"] == "human"
    assert "<think>" not in plain["conversations"][-1]["value"]
    hermes = formats.export(formats.parse(NATIVE), "hermes")
    assert hermes["completed"] is True and hermes["model"] == "qwen3-8b"
    assert "<tools>" in hermes["conversations"][0]["value"]
    assert all(
        t["value"].startswith("<think>") for t in hermes["conversations"] if t["from"] == "gpt"
    )
