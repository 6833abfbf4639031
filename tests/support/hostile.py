"""Hostile text for the parsers, shared by tests/test_formats_hostile.py (what the hub
makes of it) and bench/formats_hostile.py (how long that takes): about 1 MB of each
format's worst pattern where its parser scans text, and prose in the same shape as
the yardstick."""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Callable
from typing import Any

from tests.support.format_examples import NATIVE

MB = 1_000_000
PROSE = "a tool call failed twice; the model retried with a smaller input and it passed. "
FORMATS = ("sharegpt", "openai", "atif", "native")

# text(pattern, size) -> the text put where a parser scans: `fill` for the hostile
# pattern itself, or one that ignores the pattern (prose).
Text = Callable[[str, int], str]


def fill(pattern: str, size: int = MB) -> str:
    return (pattern * (size // len(pattern) + 1))[:size]


def prose(pattern: str, size: int) -> str:
    """Prose in place of the hostile pattern."""
    return fill(PROSE, size)


def adversarial(fmt: str, text: Text = fill) -> dict[str, Any]:
    """A trace of `fmt` carrying about 1 MB of `text(pattern, size)` where its parser
    scans text; `text` is given the hostile pattern of that place. (Not long runs of
    blanks: tiktoken counts those at ~2 s per MB, a cost of the tokenizer, which
    limits.max_item_seconds bounds.)"""
    if fmt == "sharegpt":  # many tags that never close
        return {"conversations": [
            {"from": "human", "value": "go"},
            {"from": "gpt", "value": text("<tool_call> ", MB // 2)},
            {"from": "tool", "value": text("<tool_response> ", MB // 2)}]}
    if fmt == "openai":
        return {"messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": text("</think><think> ", MB // 2)},
            {"role": "tool", "tool_call_id": "c", "content": text("<think> error:", MB // 2)}]}
    if fmt == "atif":
        return {"schema_version": "ATIF-v1.4", "session_id": uuid.uuid4().hex,
                "agent": {"name": "a", "version": "1"},
                "steps": [{"step_id": 1, "source": "user", "message": "go"},
                          {"step_id": 2, "source": "agent", "message": text("<think>", MB // 2),
                           "observation": {"results": [{"content": text("error:<", MB // 2)}]}}]}
    # native: near-duplicate thoughts and repeated calls, for the filters and rules.
    thought = text("think again about the same thing ", 250)
    steps = [step for i in range(2200) for step in (
        {"type": "thought", "content": thought[: 200 + i % 50]},
        {"type": "action", "tool": "t", "arguments": {"same": thought[:50]}, "call_id": f"c{i}"},
        {"type": "observation", "call_id": f"c{i}", "content": "error: again", "error": True})]
    return {"task": "go", "steps": steps}


def five_kb_native() -> dict[str, Any]:
    """The native example, its steps twice and its observations longer: about 5 KB."""
    item = copy.deepcopy(NATIVE)
    item["steps"] = copy.deepcopy(item["steps"] * 2)
    for step in item["steps"]:
        if step["type"] == "observation":
            step["content"] += "\ncollected 1 item, log line" * 4
    assert 4500 < len(json.dumps(item)) < 6000
    return item
