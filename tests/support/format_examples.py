"""One valid trace of each format /v1/traces accepts, as agents write them, and the
real Hermes line: the examples the tests of app/formats share."""

from __future__ import annotations

import copy
import json
from typing import Any

from app.config import EnvironmentConfig
from app.domain import Trace
from app.evaluation.environment import Environment
from tests.support import REAL

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


def kinds(trace: Trace) -> list[str]:
    return [step.type.value for step in trace.steps]


def assert_fine_tuning_record(record: dict[str, Any]) -> None:
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


def assert_atif(doc: dict[str, Any]) -> None:
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


ENVIRONMENT = Environment.from_config(EnvironmentConfig())
