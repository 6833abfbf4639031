from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from app import formats
from app.config import EnvironmentConfig, LimitsConfig
from app.domain import Status, StepType, Trace
from app.errors import HubError, Invalid, Unexportable, UnknownFormat
from app.evaluation.environment import Environment
from app.ingest.ingestor import NUL_STORED_AS, Preparer

REAL = Path(__file__).resolve().parents[1].parent / "shared/fixtures/real"
HERMES_LINE = REAL / "hermes-agent/lucifexia_trajectory_samples.jsonl"

NATIVE: dict[str, Any] = {
    "trace_id": "native-0001",
    "task": "Make the failing test in tests/test_dates.py pass.",
    "agent": {"name": "swe-mini", "model": "qwen3-8b"},
    "env": "swe-lite",
    "policy_version": "step-120",
    "tools": ["bash", "edit_file"],
    "steps": [
        {"type": "thought", "content": "Run the test first to see the failure."},
        {
            "type": "action",
            "tool": "bash",
            "arguments": {"command": "pytest tests/test_dates.py -q"},
            "call_id": "c1",
            "content": "Running the tests.",
        },
        {
            "type": "observation",
            "call_id": "c1",
            "content": "F\nE   AssertionError: '2024-1-5' != '2024-01-05'\n1 failed in 0.12s",
            "exit_code": 1,
        },
        {"type": "thought", "content": "The month and day are not zero-padded."},
        {
            "type": "action",
            "tool": "edit_file",
            "arguments": {"path": "dates.py", "old": "{d.month}", "new": "{d.month:02d}"},
            "call_id": "c2",
        },
        {"type": "observation", "call_id": "c2", "content": "", "error": "old text not found"},
        {"type": "action", "tool": "edit_file", "arguments": "{path: dates.py", "call_id": "c3"},
        {"type": "observation", "call_id": "c3", "content": "bad arguments", "error": True},
        {
            "type": "action",
            "tool": "bash",
            "arguments": {"command": "sed -i 's/{d.month}/{d.month:02d}/' dates.py"},
            "call_id": "c4",
        },
        {"type": "observation", "call_id": "c4", "content": "", "exit_code": 0},
        {"type": "message", "content": "The month is fixed. Anything else?"},
        {"type": "message", "role": "user", "content": "Also pad the day, please."},
        {
            "type": "action",
            "tool": "bash",
            "arguments": {"command": "sed -i 's/{d.day}/{d.day:02d}/' dates.py && pytest -q"},
            "call_id": "c5",
            "content": "Will do.",
        },
        {"type": "observation", "call_id": "c5", "content": "1 passed in 0.10s", "exit_code": 0},
        {"type": "final", "content": "Month and day are now zero-padded; the test passes."},
    ],
    "outcome": {"status": "success", "code_runs_ok": True},
    "metadata": {"run": "r-17", "seed": 3},
}

OPENAI: dict[str, Any] = {
    "trace_id": "oa-0001",
    "model": "gpt-4o-mini",
    "messages": [
        {"role": "system", "content": "You are a careful shell agent."},
        {"role": "user", "content": "How many Python files are under src/?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "Use find and wc.",
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {
                        "name": "bash",
                        "arguments": '{"cmd": "find src -name \'*.py\' | wc -l"}',
                    },
                },
                {
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "bash", "arguments": "ls src/ -R"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "42"},
        {"role": "tool", "tool_call_id": "call_b", "content": "Error: ls: invalid option"},
        {"role": "user", "content": "Exclude tests."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_c",
                    "type": "function",
                    "function": {
                        "name": "bash",
                        "arguments": "{\"cmd\": \"find src -name '*.py' -not -path '*test*' | wc -l\"}",
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_c", "content": "37"},
        {
            "role": "assistant",
            "reasoning": "37 after excluding tests.",
            "content": [{"type": "text", "text": "There are 37 Python files outside tests."}],
        },
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "bash",
                "description": "Run a shell command",
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
            },
        }
    ],
    "reward": 1.0,
}

_TOOLS_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools> </tools> XML tags. Here are the available tools:\n<tools>\n"
    + json.dumps(
        [
            {
                "name": "terminal",
                "description": "Run a shell command",
                "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
                "required": None,
            },
            {
                "name": "read_file",
                "description": "Read a file",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
                "required": None,
            },
        ]
    )
    + "\n</tools>\nEach function call should be enclosed within <tool_call> </tool_call> XML tags."
)

HERMES: dict[str, Any] = {
    "conversations": [
        {"from": "system", "value": _TOOLS_PROMPT},
        {"from": "human", "value": "How many lines are in notes.txt, and what is its first line?"},
        {
            "from": "gpt",
            "value": "<think>\nCount with wc, read with read_file.\n</think>\n"
            '<tool_call>\n{"name": "terminal", "arguments": {"command": "wc -l notes.txt"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "read_file", "arguments": {"path": "notes.txt"}}\n</tool_call>',
        },
        {
            "from": "tool",
            "value": '<tool_response>\n{"tool_call_id": "call_a1", "name": "terminal", '
            '"content": {"output": "12 notes.txt", "exit_code": 0, "error": null}}\n</tool_response>\n'
            '<tool_response>\n{"tool_call_id": "call_a2", "name": "read_file", '
            '"content": {"success": false, "error": "permission denied"}}\n</tool_response>',
        },
        {
            "from": "gpt",
            "value": "<think>\n</think>\nReading failed; try cat.\n"
            '<tool_call>\n{"name": "terminal", "arguments": {"command": "head -1 notes.txt"}}\n</tool_call>',
        },
        {
            "from": "tool",
            "value": '<tool_response>\n{"tool_call_id": "call_a3", "name": "terminal", '
            '"content": {"output": "# Notes", "exit_code": 0, "error": null}}\n</tool_response>',
        },
        {
            "from": "gpt",
            "value": '<think>\n</think>\nnotes.txt has 12 lines; the first is "# Notes".',
        },
    ],
    "timestamp": "2026-01-05T10:00:00.123456",
    "model": "example-org/example-model",
    "completed": True,
}

BATCH_RUNNER: dict[str, Any] = {
    "prompt_index": 7,
    "conversations": copy.deepcopy(HERMES["conversations"]),
    "metadata": {
        "batch_num": 1,
        "timestamp": "2026-01-05T10:00:00",
        "model": "claude-opus-4-20250514",
    },
    "completed": False,
    "partial": True,
    "api_calls": 4,
    "toolsets_used": ["terminal", "file"],
    "tool_stats": {
        "terminal": {"count": 2, "success": 2, "failure": 0},
        "read_file": {"count": 1, "success": 0, "failure": 1},
    },
    "tool_error_counts": {"terminal": 0, "read_file": 1},
}

ATIF: dict[str, Any] = {
    "schema_version": "ATIF-v1.4",
    "session_id": "025B810F-B3A2-4C67-93C0-FE7A142A947A",
    "agent": {"name": "harbor-agent", "version": "1.0.0", "model_name": "gemini-2.5-flash"},
    "notes": "Two tool calls in one step.",
    "final_metrics": {
        "total_prompt_tokens": 1120,
        "total_completion_tokens": 124,
        "total_steps": 3,
    },
    "steps": [
        {
            "step_id": 1,
            "source": "user",
            "message": "What is GOOGL trading at, and on what volume?",
        },
        {
            "step_id": 2,
            "source": "agent",
            "message": "I will look up price and volume.",
            "reasoning_content": "Two lookups, run together.",
            "tool_calls": [
                {
                    "tool_call_id": "call_price_1",
                    "function_name": "financial_search",
                    "arguments": {"ticker": "GOOGL", "metric": "price"},
                },
                {
                    "tool_call_id": "call_volume_2",
                    "function_name": "financial_search",
                    "arguments": {"ticker": "GOOGL", "metric": "volume"},
                },
            ],
            "observation": {
                "results": [
                    {"source_call_id": "call_price_1", "content": "GOOGL is trading at $185.35"},
                    {"source_call_id": "call_volume_2", "content": "Error: rate limited"},
                ]
            },
            "metrics": {"prompt_tokens": 520, "completion_tokens": 80},
        },
        {
            "step_id": 3,
            "source": "agent",
            "message": [
                {"type": "text", "text": "GOOGL trades at $185.35; volume is unavailable."}
            ],
        },
    ],
}

EXAMPLES = {"native": NATIVE, "openai": OPENAI, "sharegpt": HERMES, "atif": ATIF}
EXPORT_OF = {"native": "native", "openai": "openai", "sharegpt": "hermes", "atif": "atif"}


def _kinds(trace: Trace) -> list[str]:
    return [step.type.value for step in trace.steps]


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
            Preparer(_ENVIRONMENT, LimitsConfig()).row(item)


# --- openai -------------------------------------------------------------------------


def test_openai_maps_messages_to_steps() -> None:
    trace = formats.parse(OPENAI)
    assert trace.task == "How many Python files are under src/?"
    assert trace.agent.model == "gpt-4o-mini"
    assert trace.tools == ["bash"]
    # The environment's reward is kept as such; it does not make a status.
    assert trace.outcome.status is Status.UNKNOWN and trace.outcome.reward == 1.0
    assert "reward" not in trace.metadata
    assert _kinds(trace) == [
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
    assert _kinds(trace) == ["action", "observation", "thought", "final"]
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


def _assert_fine_tuning_record(record: dict[str, Any]) -> None:
    assert set(record) <= {"messages", "tools"}
    seen_calls: set[str] = set()
    roles = []
    for msg in record["messages"]:
        roles.append(msg["role"])
        assert msg["role"] in {"system", "user", "assistant", "tool"}
        if msg["role"] == "tool":
            assert msg["tool_call_id"] in seen_calls
            assert isinstance(msg["content"], str)
        elif msg.get("tool_calls"):
            for call in msg["tool_calls"]:
                assert call["type"] == "function" and isinstance(call["id"], str)
                assert isinstance(call["function"]["name"], str)
                assert isinstance(call["function"]["arguments"], str)
                seen_calls.add(call["id"])
        else:
            assert isinstance(msg["content"], str)
    assert "assistant" in roles
    for tool in record.get("tools", []):
        assert tool["type"] == "function"
        assert isinstance(tool["function"]["name"], str)
        assert tool["function"]["parameters"]["type"] == "object"


@pytest.mark.parametrize("name", EXAMPLES)
def test_openai_export_is_a_fine_tuning_record(name: str) -> None:
    record = formats.export(formats.parse(EXAMPLES[name]), "openai")
    _assert_fine_tuning_record(record)
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
    _assert_fine_tuning_record(record)
    ids = [m["tool_call_id"] for m in record["messages"] if m["role"] == "tool"]
    assert ids[0] == "call_1" and ids[1] not in ("call_1", "")
    again = formats.parse(record)
    assert again.steps[3].call_id == again.steps[2].call_id == ids[1]


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
    assert _kinds(trace) == ["thought", "final"]
    assert trace.steps[1].content == "Hello! I am Lucifex Agent. How can I help you today?"
    # Hermes export writes the same conversation back, system prompt included.
    assert formats.export(trace, "hermes")["conversations"] == item["conversations"]


def test_hermes_calls_results_and_errors() -> None:
    trace = formats.parse(HERMES)
    assert trace.tools == ["terminal", "read_file"]
    assert (
        trace.outcome.status is Status.SUCCESS and trace.agent.model == "example-org/example-model"
    )
    assert _kinds(trace) == [
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
    assert _kinds(trace) == ["action", "observation", "action", "observation", "message"]
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


# --- atif ---------------------------------------------------------------------------


def test_atif_maps_steps() -> None:
    trace = formats.parse(ATIF)
    assert trace.trace_id == ATIF["session_id"]
    assert trace.agent.name == "harbor-agent" and trace.agent.model == "gemini-2.5-flash"
    assert trace.task == "What is GOOGL trading at, and on what volume?"
    assert _kinds(trace) == ["thought", "action", "action", "observation", "observation", "final"]
    assert trace.steps[1].content == "I will look up price and volume."
    assert trace.steps[4].error == "Error: rate limited"
    assert trace.steps[-1].content == "GOOGL trades at $185.35; volume is unavailable."
    assert trace.metadata["final_metrics"]["total_steps"] == 3
    assert trace.metadata["agent_version"] == "1.0.0"
    assert formats.parse({**ATIF, "trace_id": "mine"}).trace_id == "mine"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"schema_version": "ATIF-v2.0"}, "schema_version"),
        ({"schema_version": 1.4}, "schema_version"),
        ({"steps": [{"step_id": 1, "source": "bot", "message": "x"}]}, "steps[0].source"),
        (
            {"steps": [{"step_id": 1, "source": "agent", "message": "x", "tool_calls": [{}]}]},
            "steps[0].tool_calls[0].function_name",
        ),
        (
            {"steps": [{"step_id": 1, "source": "agent", "message": "", "observation": {}}]},
            "steps[0].observation.results",
        ),
        ({"session_id": 5}, "session_id"),
    ],
)
def test_atif_errors(change: dict[str, Any], field: str) -> None:
    with pytest.raises(Invalid) as err:
        formats.parse({**ATIF, **change})
    assert err.value.field == field


def _assert_atif(doc: dict[str, Any]) -> None:
    assert doc["schema_version"].startswith("ATIF-v1.")
    assert isinstance(doc["session_id"], str) and doc["session_id"]
    assert isinstance(doc["agent"]["name"], str) and isinstance(doc["agent"]["version"], str)
    assert [s["step_id"] for s in doc["steps"]] == list(range(1, len(doc["steps"]) + 1))
    for step in doc["steps"]:
        assert step["source"] in {"system", "user", "agent"}
        assert isinstance(step["message"], str)
        if step["source"] != "agent":
            assert not {"reasoning_content", "tool_calls", "metrics", "observation"} & set(step)
        ids = set()
        for call in step.get("tool_calls", []):
            assert set(call) == {"tool_call_id", "function_name", "arguments"}
            assert isinstance(call["arguments"], dict)
            ids.add(call["tool_call_id"])
        for result in step.get("observation", {}).get("results", []):
            assert set(result) <= {"source_call_id", "content"}
            assert result.get("source_call_id", next(iter(ids), None)) in ids
    assert isinstance(doc.get("extra", {}), dict)


@pytest.mark.parametrize("name", EXAMPLES)
def test_atif_export_has_required_fields(name: str) -> None:
    doc = formats.export(formats.parse(EXAMPLES[name]), "atif")
    _assert_atif(doc)
    json.dumps(doc)


def test_atif_export_keeps_what_atif_has_no_field_for() -> None:
    doc = formats.export(formats.parse(NATIVE), "atif")
    assert doc["session_id"] == "native-0001"
    assert doc["extra"]["atropos_hub"]["outcome"] == {"status": "success", "code_runs_ok": True}
    assert doc["extra"]["run"] == "r-17"
    back = formats.parse(doc)
    assert back.outcome.status is Status.SUCCESS and back.tools == ["bash", "edit_file"]
    assert back.env == "swe-lite" and back.metadata["run"] == "r-17"


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
    _assert_atif(doc)


def test_openai_export_stays_a_fine_tuning_record_with_an_env_reward() -> None:
    # Fine-tuning APIs validate these records: the reward goes beside them, not in.
    record = formats.export(formats.parse({**OPENAI, "reward": 0.25}), "openai")
    _assert_fine_tuning_record(record)


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


# --- robustness -----------------------------------------------------------------------

_KEYS = st.sampled_from(
    [
        "format",
        "trace_id",
        "task",
        "steps",
        "type",
        "content",
        "role",
        "tool",
        "arguments",
        "call_id",
        "error",
        "exit_code",
        "messages",
        "tool_calls",
        "function",
        "name",
        "tool_call_id",
        "reasoning_content",
        "conversations",
        "from",
        "value",
        "completed",
        "schema_version",
        "session_id",
        "agent",
        "source",
        "message",
        "observation",
        "results",
        "source_call_id",
        "function_name",
        "outcome",
        "status",
        "reward",
        "tools",
        "metadata",
        "extra",
        "model",
        "text",
        "id",
    ]
)
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.sampled_from(
        [
            *[
                "native",
                "openai",
                "sharegpt",
                "hermes",
                "atif",
                "ATIF-v1.4",
                "thought",
                "action",
                "observation",
                "message",
                "final",
                "user",
                "assistant",
                "tool",
                "system",
                "gpt",
                "human",
                "agent",
                "success",
            ],
            "Error: x",
            '<think>a</think><tool_call>{"name": "x", "arguments": {}}</tool_call>',
            '<tool_response>{"content": {"error": 1}}</tool_response>',
            '<tools>[{"name": "t"}]</tools>',
        ]
    )
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(_KEYS | st.text(max_size=5), inner, max_size=6)
    ),
    max_leaves=40,
)


def _parse_fails_only_with_hub_errors(body: Any, fmt: str | None) -> None:
    try:
        trace = formats.parse(body, fmt)
    except HubError:
        return
    # Whatever parses is a valid Trace, exports to every format, and the export parses
    # again (or is refused with a HubError, e.g. a native export of a trace without task).
    Trace.model_validate(trace.model_dump())
    for target in formats.EXPORTS:
        try:
            exported = formats.export(trace, target)
        except Unexportable:
            assert target == "openai"  # a training record needs an assistant turn
            continue
        json.dumps(exported)
        try:
            formats.parse(exported, "hermes" if target == "hermes" else None)
        except HubError:
            pass


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_JSON, st.sampled_from([None, "native", "openai", "sharegpt", "atif"]))
def test_random_bodies_fail_only_with_hub_errors(body: Any, fmt: str | None) -> None:
    _parse_fails_only_with_hub_errors(body, fmt)


def _tagged(tag: str) -> st.SearchStrategy[str]:
    return st.builds(lambda body: f"<{tag}>\n{json.dumps(body)}\n</{tag}>", _JSON)


_TEXTS = st.text(max_size=30) | _tagged("tool_call") | _tagged("tool_response") | _tagged("tools")
_TURN_VALUES = st.lists(_TEXTS, max_size=3).map("\n".join)
_NEAR_NATIVE = st.fixed_dictionaries(
    {
        "task": st.text(min_size=1, max_size=10),
        "steps": st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from([t.value for t in StepType])},
                optional={
                    k: _JSON
                    for k in ("content", "tool", "arguments", "call_id", "error", "exit_code")
                },
            ),
            max_size=5,
        ),
    },
    optional={"outcome": _JSON, "tools": _JSON},
)
_NEAR_OPENAI = st.fixed_dictionaries(
    {
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["system", "user", "assistant", "tool", "function"])},
                optional={
                    "content": _JSON | _TURN_VALUES,
                    "reasoning_content": _JSON,
                    "tool_call_id": _JSON,
                    "tool_calls": st.lists(
                        st.fixed_dictionaries(
                            {
                                "id": _JSON,
                                "function": st.fixed_dictionaries(
                                    {"name": st.text(max_size=5)}, optional={"arguments": _JSON}
                                ),
                            }
                        ),
                        max_size=3,
                    ),
                },
            ),
            max_size=6,
        )
    },
    optional={"tools": _JSON, "reward": _JSON, "status": _JSON},
)
_NEAR_SHAREGPT = st.fixed_dictionaries(
    {
        "conversations": st.lists(
            st.fixed_dictionaries(
                {"from": st.sampled_from(["system", "human", "gpt", "tool"]), "value": _TURN_VALUES}
            ),
            max_size=6,
        )
    },
    optional={"completed": _JSON, "model": _JSON, "metadata": _JSON, "partial": _JSON},
)
_NEAR_ATIF = st.fixed_dictionaries(
    {
        "schema_version": st.just("ATIF-v1.4"),
        "steps": st.lists(
            st.fixed_dictionaries(
                {
                    "source": st.sampled_from(["system", "user", "agent"]),
                    "message": _JSON | st.text(),
                },
                optional={
                    "reasoning_content": _JSON,
                    "tool_calls": st.lists(
                        st.fixed_dictionaries(
                            {"tool_call_id": _JSON, "function_name": st.text(max_size=5)},
                            optional={"arguments": _JSON},
                        ),
                        max_size=3,
                    ),
                    "observation": st.fixed_dictionaries(
                        {
                            "results": st.lists(
                                st.dictionaries(
                                    st.sampled_from(["source_call_id", "content"]), _JSON
                                ),
                                max_size=3,
                            )
                        }
                    ),
                    "extra": _JSON,
                },
            ),
            max_size=5,
        ),
    },
    optional={"agent": _JSON, "extra": _JSON, "session_id": _JSON},
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_NEAR_NATIVE | _NEAR_OPENAI | _NEAR_SHAREGPT | _NEAR_ATIF)
def test_near_valid_bodies_fail_only_with_hub_errors(body: dict[str, Any]) -> None:
    _parse_fails_only_with_hub_errors(body, None)


# What JSON from elsewhere than an HTTP body can hold (`atropos import` reads files
# with the standard library): lone surrogates, integers past 64 bits, nesting past what
# orjson writes; and long text.
_ODD = st.sampled_from(["\ud800", "a\udfffb", 2**64, -(2**63) - 1, "x" * 5000])
_NASTY = _SCALARS | _ODD


def _nested(levels: int) -> Any:
    value: Any = []
    for _ in range(levels):
        value = {"a": value}
    return value


_NASTY_JSON = st.recursive(
    _NASTY | st.integers(min_value=240, max_value=300).map(_nested),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(_KEYS | st.text(max_size=5), inner, max_size=6)
    ),
    max_leaves=30,
)


def _leaf_paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(value, dict):
        children = value.items()
    elif isinstance(value, list):
        children = enumerate(value)
    else:
        return [path]
    return [path, *(p for key, child in children for p in _leaf_paths(child, (*path, key)))]


@st.composite
def _example_with_one_value_swapped(draw: st.DrawFn) -> dict[str, Any]:
    """A valid trace of each format (and a batch_runner line) with one value, anywhere
    in it, replaced by something odd: the parsers see every field go wrong in turn."""
    example = copy.deepcopy(draw(st.sampled_from([*EXAMPLES.values(), BATCH_RUNNER])))
    *parents, last = draw(st.sampled_from(_leaf_paths(example)[1:]))
    target = example
    for key in parents:
        target = target[key]
    target[last] = draw(_ODD | _NASTY_JSON)
    return example


_LIMITS = st.builds(
    LimitsConfig,
    max_steps_per_trace=st.integers(min_value=1, max_value=8),
    max_step_chars=st.integers(min_value=1, max_value=200),
    max_json_depth=st.integers(min_value=2, max_value=12),
) | st.just(LimitsConfig())
_ENVIRONMENT = Environment.from_config(EnvironmentConfig())


def _prepare_fails_only_with_hub_errors(body: Any, fmt: str | None, limits: LimitsConfig) -> None:
    """Beyond the parsers: the limits, scoring, filters and token count that ingest runs
    on every item refuse bad input only with a HubError, and what they accept is a row
    the database can store (JSON that orjson writes)."""
    try:
        row = Preparer(_ENVIRONMENT, limits).row(body, fmt)
    except HubError as exc:
        event(f"refused: {type(exc).__name__}")
        return
    event("prepared")
    for column in ("reward_breakdown", "reject_reasons"):
        orjson.dumps(row[column])
    # Stored as sent, but for NUL, which neither database can store in text.
    assert orjson.loads(row["original"].text) == _nul_replaced(orjson.loads(orjson.dumps(body)))
    assert len(orjson.loads(row["trace"].text)["steps"]) <= limits.max_steps_per_trace
    # The stored trace is pydantic's own JSON of the canonical trace, however it is written.
    text = row["trace"].text
    assert Trace.model_validate(orjson.loads(text)).model_dump_json(exclude_none=True) == text


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    _NASTY_JSON | _NEAR_NATIVE | _NEAR_OPENAI | _NEAR_SHAREGPT | _NEAR_ATIF,
    st.sampled_from([None, "native", "openai", "sharegpt", "atif"]),
    _LIMITS,
)
def test_random_bodies_through_the_whole_preparation(
    body: Any, fmt: str | None, limits: LimitsConfig
) -> None:
    _prepare_fails_only_with_hub_errors(body, fmt, limits)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(_example_with_one_value_swapped())
@example({**NATIVE, "task": "a\ud800"})  # found by it: once a TypeError, now a 422
def test_valid_traces_with_one_odd_value(body: dict[str, Any]) -> None:
    _prepare_fails_only_with_hub_errors(body, None, LimitsConfig())


def test_native_parse_is_fast() -> None:
    """Not a benchmark: a gross regression guard (the target is well under 200 µs)."""
    import time

    item = _five_kb_native()
    formats.parse(item)
    start = time.perf_counter()
    for _ in range(200):
        formats.parse(item)
    assert (time.perf_counter() - start) / 200 < 0.002


def _five_kb_native() -> dict[str, Any]:
    item = copy.deepcopy(NATIVE)
    item["steps"] = copy.deepcopy(item["steps"] * 2)
    for step in item["steps"]:
        if step["type"] == "observation":
            step["content"] += "\ncollected 1 item, log line" * 4
    assert 4500 < len(json.dumps(item)) < 6000
    return item


def test_arguments_that_are_not_an_object_are_kept_for_scoring() -> None:
    """An agent that sent an array or a number as arguments made an invalid tool call:
    the trace is stored and `invalid_tool_call` scores it, rather than a 422."""
    trace = formats.parse({"messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "a", "arguments": 4}}]},
    ]})
    assert [s.arguments for s in trace.steps if s.type == "action"] == [4]


# --- linear time on hostile text (issue 17) ----------------------------------------------

_MB = 1_000_000
_PROSE = ("the agent reads the file, counts its lines and reports the number it found. ",
          "a tool call failed twice; the model retried with a smaller input and it passed. ")


def _fill(pattern: str, size: int = _MB) -> str:
    return (pattern * (size // len(pattern) + 1))[:size]


def _adversarial(fmt: str, text: Any) -> dict[str, Any]:
    """A trace of `fmt` carrying about 1 MB of `text(pattern, size)` where its parser
    scans text; `text` is given the hostile pattern of that place. (Not long runs of
    blanks: tiktoken counts those at ~2 s per MB, a cost of the tokenizer, which
    limits.max_item_seconds bounds.)"""
    if fmt == "sharegpt":  # the attack: many tags that never close
        return {"conversations": [
            {"from": "human", "value": "go"},
            {"from": "gpt", "value": text("<tool_call> ", _MB // 2)},
            {"from": "tool", "value": text("<tool_response> ", _MB // 2)}]}
    if fmt == "openai":
        return {"messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": text("</think><think> ", _MB // 2)},
            {"role": "tool", "tool_call_id": "c", "content": text("<think> error:", _MB // 2)}]}
    if fmt == "atif":
        return {"schema_version": "ATIF-v1.4", "session_id": uuid.uuid4().hex,
                "agent": {"name": "a", "version": "1"},
                "steps": [{"step_id": 1, "source": "user", "message": "go"},
                          {"step_id": 2, "source": "agent", "message": text("<think>", _MB // 2),
                           "observation": {"results": [{"content": text("error:<", _MB // 2)}]}}]}
    # native: near-duplicate thoughts and repeated calls, for the filters and rules.
    thought = text("think again about the same thing ", 250)
    steps = [step for i in range(2200) for step in (
        {"type": "thought", "content": thought[: 200 + i % 50]},
        {"type": "action", "tool": "t", "arguments": {"same": thought[:50]}, "call_id": f"c{i}"},
        {"type": "observation", "call_id": f"c{i}", "content": "error: again", "error": True})]
    return {"task": "go", "steps": steps}


@pytest.mark.parametrize("fmt", ["sharegpt", "openai", "atif", "native"])
def test_a_hostile_megabyte_is_answered_in_linear_time(
    fmt: str, start_hub: Any, tmp_path: Path
) -> None:
    """Through the real ingest path: a 144 KB ShareGPT turn of "<tool_call> " took 49 s;
    at 1 MB, 40 min. Here each format's hostile megabyte must be answered in under 1 s,
    or, on a machine too loaded for that, in under 4 times what a megabyte of prose
    in the same shape takes (quadratic work would take minutes either way)."""
    import time

    hub = start_hub({"storage_backend": "sqlite", "db_path": str(tmp_path / "t.db")},
                    "--no-workers", limits={"max_step_chars": 2 * _MB})
    texts = {
        "warm-up": lambda _, n: _fill(_PROSE[0], n),  # the tokenizer and caches
        "prose": lambda _, n: _fill(_PROSE[1], n),
        "hostile": _fill,
    }
    took = {}
    with hub.client() as client:
        for kind, text in texts.items():
            body = orjson.dumps(_adversarial(fmt, text))
            started = time.monotonic()
            r = client.post("/v1/traces", content=body,
                            headers={"content-type": "application/json"})
            took[kind] = time.monotonic() - started
            assert r.status_code == 202, (kind, r.text[:300])
            assert len(body) > 0.9 * _MB
    assert took["hostile"] < max(1.0, 4 * took["prose"]), took


def _nul_replaced(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("\x00", NUL_STORED_AS)
    if isinstance(value, dict):
        return {_nul_replaced(k): _nul_replaced(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nul_replaced(v) for v in value]
    return value
