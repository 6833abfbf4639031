"""The openai format (app/formats/openai.py): messages to steps, and the fine-tuning
record it exports."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app import formats
from app.domain import Status
from app.errors import Invalid, Unexportable
from tests.support.format_examples import (
    EXAMPLES,
    NATIVE,
    OPENAI,
    assert_fine_tuning_record,
    kinds,
)

# --- openai -------------------------------------------------------------------------


def test_openai_maps_messages_to_steps() -> None:
    trace = formats.parse(OPENAI)
    assert trace.task == "How many Python files are under src/?"
    assert trace.agent.model == "gpt-4o-mini"
    assert trace.tools == ["bash"]
    # The environment's reward is kept as such; it does not make a status.
    assert trace.outcome.status is Status.UNKNOWN and trace.outcome.reward == 1.0
    assert "reward" not in trace.metadata
    assert kinds(trace) == [
        "message",
        "thought",
        "action",
        "action",
        "observation",
        "observation",
        "message",
        "action",
        "observation",
        "thought",
        "final",
    ]
    first, second = trace.steps[2], trace.steps[3]
    assert first.content == "Let me look." and first.arguments == {
        "cmd": "find src -name '*.py' | wc -l"
    }
    assert second.arguments == "ls src/ -R"
    assert (
        trace.steps[5].call_id == "call_b" and trace.steps[5].error == "Error: ls: invalid option"
    )
    assert trace.steps[-1].content == "There are 37 Python files outside tests."


def test_openai_legacy_function_call_and_inline_think() -> None:
    trace = formats.parse(
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "function_call": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                },
                {"role": "function", "name": "weather", "content": "rain"},
                {"role": "assistant", "content": "<think>It rains.</think>Take an umbrella."},
            ],
            "functions": [{"name": "weather", "parameters": {"type": "object"}}],
            "status": "failure",
        }
    )
    assert trace.tools == ["weather"] and trace.outcome.status is Status.FAILURE
    assert kinds(trace) == ["action", "observation", "thought", "final"]
    assert trace.steps[0].arguments == {"city": "Oslo"}
    assert trace.steps[3].content == "Take an umbrella."


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ("hi", "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        (
            [{"role": "assistant", "tool_calls": [{"id": "1", "function": {}}]}],
            "messages[0].tool_calls[0].function.name",
        ),
        ([{"role": "tool", "tool_call_id": 5, "content": "x"}], "messages[0].tool_call_id"),
    ],
)
def test_openai_errors(messages: Any, field: str) -> None:
    with pytest.raises(Invalid) as err:
        formats.parse({"messages": messages})
    assert err.value.field == field


def test_openai_bad_outcome_keys() -> None:
    with pytest.raises(Invalid) as err:
        formats.parse({"messages": [], "status": "done"})
    assert err.value.field == "status" and "success, failure" in err.value.message
    with pytest.raises(Invalid) as err:
        formats.parse({"messages": [], "reward": "high"})
    assert err.value.field == "reward"




@pytest.mark.parametrize("name", EXAMPLES)
def test_openai_export_is_a_fine_tuning_record(name: str) -> None:
    record = formats.export(formats.parse(EXAMPLES[name]), "openai")
    assert_fine_tuning_record(record)
    json.dumps(record)


def test_openai_export_keeps_schemas_and_says_errors() -> None:
    record = formats.export(formats.parse(NATIVE), "openai")
    assert record["tools"][0]["function"]["name"] == "bash"
    tool_msgs = [m for m in record["messages"] if m["role"] == "tool"]
    assert tool_msgs[1]["content"] == "Error: old text not found"
    assert record["messages"][0] == {"role": "user", "content": NATIVE["task"]}
    oa = formats.export(formats.parse(OPENAI), "openai")
    assert oa["tools"] == OPENAI["tools"]
    assert oa["messages"][0]["role"] == "system"


def test_exports_link_results_to_calls_without_ids() -> None:
    item = {
        "task": "t",
        "tools": [{"name": "sh", "description": "shell", "parameters": {"type": "object"}}],
        "steps": [
            {"type": "action", "tool": "sh", "arguments": {"c": "ls"}, "call_id": "call_1"},
            {"type": "observation", "call_id": "call_1", "content": "a"},
            {"type": "action", "tool": "sh", "arguments": {"c": "pwd"}},
            {"type": "observation", "content": "/"},
            {"type": "final", "content": "done"},
        ],
    }
    trace = formats.parse(item)
    assert trace.tools == ["sh"]
    assert trace.metadata["tool_schemas"][0]["function"]["description"] == "shell"
    record = formats.export(trace, "openai")
    assert_fine_tuning_record(record)
    ids = [m["tool_call_id"] for m in record["messages"] if m["role"] == "tool"]
    assert ids[0] == "call_1" and ids[1] not in ("call_1", "")
    again = formats.parse(record)
    assert again.steps[3].call_id == again.steps[2].call_id == ids[1]


def test_messages_export_gives_arguments_as_objects_and_every_tool_a_description() -> None:
    declared = {"type": "function", "function": {
        "name": "bash", "description": "Run a command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}
    trace = formats.parse({"messages": [
        {"role": "user", "content": "list"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}},
            {"id": "c2", "type": "function", "function": {"name": "grep", "arguments": '{"q": "x"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
        {"role": "tool", "tool_call_id": "c2", "content": ""},
        {"role": "assistant", "content": "a.py"}], "tools": [declared, "grep"]})
    openai_record, record = formats.export(trace, "openai"), formats.export(trace, "messages")
    calls = record["messages"][1]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == [{"cmd": "ls"}, {"q": "x"}]
    assert [c["function"]["arguments"] for c in openai_record["messages"][1]["tool_calls"]] \
        == ['{"cmd":"ls"}', '{"q":"x"}']
    # The declared description as it was; the implied schema's an empty one, never made up.
    assert [t["function"]["description"] for t in record["tools"]] == ["Run a command", ""]
    assert record["tools"][1]["function"]["parameters"]["properties"] == {"q": {"type": "string"}}

    raw = formats.parse({"messages": [
        {"role": "user", "content": "run"},
        {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "ls -la"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
        {"role": "assistant", "content": "done"}]})
    with pytest.raises(Unexportable, match="not a JSON object: bash was called with"):
        formats.export(raw, "messages")
    assert formats.export(raw, "openai")["messages"][1]["tool_calls"][0]["function"][
        "arguments"] == "ls -la"
