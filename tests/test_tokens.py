"""Token counts count what the model sees: the system prompt, the tool schemas and
every message (app/ingest/tokens.py counts `Trace.text_parts`)."""

from __future__ import annotations

import json
from typing import Any

from app import formats
from app.compression.ledger import Ledger
from app.ingest.tokens import count_parts, count_tokens
from tests.support import REAL

HERMES_LINE = REAL / "hermes-agent/lucifexia_trajectory_samples.jsonl"
SCHEMA = {"type": "function", "function": {
    "name": "terminal", "description": "Run a shell command and return its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}


def _tokens(item: dict[str, Any]) -> int:
    return count_parts(formats.parse(item).text_parts())


def test_a_real_hermes_line_counts_its_tool_schemas() -> None:
    item = json.loads(HERMES_LINE.read_text(encoding="utf-8").splitlines()[0])
    as_sent = sum(count_tokens(turn["value"]) for turn in item["conversations"])
    counted = _tokens(item)
    # ~13k tokens, almost all of them the tool schemas in the system prompt; it was 68.
    assert as_sent > 11_000
    # The schemas as a template lists them; the template's own prose (a few hundred
    # tokens of "You are a function calling AI model...") is not counted.
    assert 0.97 * as_sent < counted <= as_sent


def test_system_prompt_tool_schemas_and_every_message_count() -> None:
    messages = [{"role": "user", "content": "How many lines are in notes.txt?"},
                {"role": "assistant", "content": "12."}]
    base = _tokens({"messages": messages})
    system = "You are a careful assistant. Answer in one sentence."
    with_system = _tokens({"messages": [{"role": "system", "content": system}, *messages]})
    assert with_system - base >= count_tokens(system)
    with_tools = _tokens({"messages": messages, "tools": [SCHEMA]})
    assert with_tools - base >= count_tokens(json.dumps(SCHEMA)) - 2
    # A tool known only by name counts its name.
    named = _tokens({"task": "t", "steps": [], "tools": ["terminal"]})
    assert named == count_parts(["terminal", "t"])


def test_the_compression_ledger_counts_the_same_text() -> None:
    """Compression aims at a share of total_tokens: its own running total must count
    the tool list and the task too, or it would aim at the wrong number."""
    trace = formats.parse({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "terminal", "arguments": "{\"command\": \"ls\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt\nb.txt"},
        {"role": "assistant", "content": "a.txt and b.txt."}], "tools": [SCHEMA]})
    total = count_parts(trace.text_parts())
    assert abs(Ledger.of(trace).total - total) <= len(trace.steps) + 2
