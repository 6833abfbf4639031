"""`atropos export`: every format validates against its spec, filters apply, the
compressed view is used on request, progress goes to stderr, and the stream is paged."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from app import formats
from app.cli import export
from app.cli.export import ExportQuery, export_traces
from app.db.models import TRACES
from tests.support.builders import long_trace
from tests.support.databases import database
from tests.support.hubs import InProcessHub
from tests.support.pipeline import ingest, set_rewards
from tests.support.processes import run_cli

ATIF_VERSION = re.compile(r"ATIF-v1\.\d+")
OPENAI_ROLES = {"system", "user", "assistant", "tool"}
ASSISTANT_KEYS = {"role", "content", "tool_calls", "reasoning_content", "name", "weight"}


def check_openai(record: dict[str, Any], arguments: type = str) -> None:
    """OpenAI chat fine-tuning JSONL: messages (+ tools); one system message, first;
    every tool message answers a call of the assistant message before it, and every
    call has exactly one result, but those of the last message (the record ends on the
    model's last turn, its results trimmed); arguments are JSON text; no assistant
    message is empty. `reasoning_content` is allowed on assistant messages (the
    DeepSeek/Hermes convention for reasoning)."""
    assert set(record) <= {"messages", "tools", "parallel_tool_calls"}
    waiting: set[str] = set()  # calls of the last assistant message without a result yet
    messages = record["messages"]
    assert messages and messages[-1]["role"] == "assistant"
    assert all(m["role"] != "system" for m in messages[1:])
    for before, m in zip([None, *messages], messages):
        assert m["role"] in OPENAI_ROLES
        if m["role"] != "tool":
            assert not waiting, f"calls without a result: {waiting}"
        if m["role"] == "assistant":
            assert set(m) <= ASSISTANT_KEYS and ("content" in m or "tool_calls" in m)
            assert m.get("content") or m.get("tool_calls") or m.get("reasoning_content")
            for call in m.get("tool_calls", []):
                assert call["type"] == "function" and isinstance(call["id"], str)
                assert isinstance(call["function"]["name"], str)
                assert isinstance(call["function"]["arguments"], arguments)
                assert call["id"] not in waiting
                waiting.add(call["id"])
            if m is messages[-1]:
                waiting.clear()
        elif m["role"] == "tool":
            assert before is not None and before["role"] in ("assistant", "tool")
            assert m["tool_call_id"] in waiting and isinstance(m["content"], str)
            waiting.remove(m["tool_call_id"])
        else:
            assert isinstance(m["content"], str)
            assert not (m["role"] == "user" and before is not None and before["role"] == "user")


def check_messages(record: dict[str, Any]) -> None:
    """The chat-template shape: the OpenAI record with arguments as objects and a
    description on every tool."""
    check_openai(record, arguments=dict)
    assert all(isinstance(t["function"]["description"], str) for t in record.get("tools", []))


def check_sharegpt(record: dict[str, Any]) -> None:
    turns = record["conversations"]
    assert {t["from"] for t in turns} <= {"system", "human", "gpt", "tool"}
    assert all(isinstance(t["value"], str) for t in turns)
    assert any(t["from"] == "human" for t in turns) and any(t["from"] == "gpt" for t in turns)
    for before, turn in zip(turns, turns[1:]):
        if turn["from"] == "tool":
            assert before["from"] == "gpt" and "<tool_call>" in before["value"]
            blocks = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", turn["value"], re.S)
            assert blocks and all("tool_call_id" in json.loads(b) for b in blocks)


def check_hermes(record: dict[str, Any]) -> None:
    """Hermes Agent's trajectory lines: system turn 0 with <tools>, human turn 1, a think
    block in every gpt turn, `completed`."""
    check_sharegpt(record)
    turns = record["conversations"]
    assert turns[0]["from"] == "system" and "<tools>" in turns[0]["value"]
    assert turns[1]["from"] == "human"
    assert all("<think>" in t["value"] for t in turns if t["from"] == "gpt")
    assert isinstance(record["completed"], bool)
    assert isinstance(record.get("model", ""), str)  # when the trace names its model


def check_atif(record: dict[str, Any]) -> None:
    assert ATIF_VERSION.fullmatch(record["schema_version"])
    assert isinstance(record["session_id"], str)
    assert isinstance(record["agent"]["name"], str) and isinstance(record["agent"]["version"], str)
    steps = record["steps"]
    assert [s["step_id"] for s in steps] == list(range(1, len(steps) + 1))
    for step in steps:
        assert step["source"] in {"system", "user", "agent"}
        assert isinstance(step["message"], str)
        if step["source"] != "agent":
            assert not {"tool_calls", "observation", "reasoning_content"} & set(step)
        for call in step.get("tool_calls", []):
            assert isinstance(call["tool_call_id"], str) and isinstance(call["function_name"], str)
            assert isinstance(call["arguments"], dict)
        for result in step.get("observation", {}).get("results", []):
            assert "content" in result


CHECKS = {"openai": check_openai, "messages": check_messages, "sharegpt": check_sharegpt, "hermes": check_hermes,
          "atif": check_atif}


def run_export(hub: InProcessHub, out: Path, *args: str) -> list[dict[str, Any]]:
    done = run_cli("export", "--config", str(hub.config), "-o", str(out), *args)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.process
async def test_every_format_validates_and_filters_apply(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    hub = start_hub(trace_server, "--no-workers")
    openai_trace = {"trace_id": "e-openai", "messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "k1", "type": "function",
         "function": {"name": "calc", "arguments": "{\"expr\": \"2+2\"}"}}]},
        {"role": "tool", "tool_call_id": "k1", "content": "4"},
        {"role": "assistant", "content": "4"}]}
    sharegpt_trace = {"trace_id": "e-sharegpt", "conversations": [
        {"from": "human", "value": "hi"}, {"from": "gpt", "value": "<think>\n</think>\nhello"}]}
    with hub.client() as client:
        ingest(client, ["e-0", "e-1"])
        for item in (openai_trace, sharegpt_trace):
            assert client.post("/v1/traces", json=item).status_code == 202
        ingest(client, ["e-rejected"])
    ids = ["e-0", "e-1", "e-openai", "e-sharegpt"]
    await set_rewards(trace_server, {"e-0": 1.0, "e-1": 9.0, "e-openai": 9.0,
                                     "e-sharegpt": 3.0, "e-rejected": 9.0})
    async with database(trace_server) as engine, engine.begin() as conn:
        await conn.execute(sa.update(TRACES).where(TRACES.c.trace_id == "e-rejected").values(stage="rejected"))

    # By default, what training would get: not rejected, reward >= the threshold (5).
    done = run_cli("export", "--config", str(hub.config), "--format", "atif",
                   "-o", str(tmp_path / "default.jsonl"))
    assert done.returncode == 0, done.stderr
    default = [json.loads(line) for line in (tmp_path / "default.jsonl").read_text().splitlines()]
    assert [r["session_id"] for r in default] == ["e-1", "e-openai"]
    assert "left out 3: 2 reward under 5, 1 rejected" in done.stderr

    # Every stage a trace that passed its filters may be in: a small one enters past
    # the stages, below_threshold by its reward as stored.
    passed = [arg for stage in ("accepted", "compression_skipped", "below_threshold")
              for arg in ("--stage", stage)]
    exported = {fmt: run_export(hub, tmp_path / f"{fmt}.jsonl", "--format", fmt,
                                "--all", *passed) for fmt in CHECKS}
    for fmt, records in exported.items():
        assert len(records) == len(ids), fmt  # the rejected trace is left out
        for record in records:
            CHECKS[fmt](record)
            formats.parse(record)  # and the hub reads its own export back
    assert [r["session_id"] for r in exported["atif"]] == ids  # oldest first
    everything = run_export(hub, tmp_path / "all.jsonl", "--format", "atif", "--all")
    assert [r["session_id"] for r in everything] == [*ids, "e-rejected"]

    high = run_export(hub, tmp_path / "high.jsonl", "--format", "atif", "--all",
                      *passed, "--min-reward", "9")
    assert [r["session_id"] for r in high] == ["e-1", "e-openai"]
    assert run_export(hub, tmp_path / "recent.jsonl", "--format", "atif", "--since", "1h")
    assert not run_export(hub, tmp_path / "future.jsonl", "--format", "atif", "--all",
                          "--since", "2999-01-01")
    rejected = run_export(hub, tmp_path / "rej.jsonl", "--format", "atif", "--all",
                          "--stage", "rejected")
    assert [r["session_id"] for r in rejected] == ["e-rejected"]


@pytest.mark.process
def test_compressed_view_progress_and_stdout(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    hub = start_hub(trace_server, "--no-workers")
    with hub.client() as client:
        assert client.post("/v1/traces", json=long_trace("long")).status_code == 202
    hub.drain()  # compresses it, as `atropos worker --burst` would
    whole = run_export(hub, tmp_path / "whole.jsonl", "--format", "openai")
    short = run_export(hub, tmp_path / "short.jsonl", "--format", "openai", "--compressed")
    assert len(json.dumps(short[0])) < len(json.dumps(whole[0])) / 2
    check_openai(short[0])

    done = run_cli("export", "--config", str(hub.config), "--format", "sharegpt", "-o", "-")
    assert done.returncode == 0
    assert [json.loads(line)["conversations"][0]["from"] for line in done.stdout.splitlines()] \
        == ["human"]
    assert "exported: 1/1" in done.stderr  # the progress line


async def test_export_is_paged_and_complete(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = start_hub(trace_server, "--no-workers")
    ids = [f"p{i:02d}" for i in range(7)]
    with hub.client() as client:
        ingest(client, ids)
    monkeypatch.setattr(export, "PAGE", 2)
    out = tmp_path / "paged.jsonl"
    async with database(trace_server) as engine:
        with open(out, "wb") as f:
            tally = await export_traces(engine, ExportQuery("atif"), f)
    assert tally.total == 7 and not tally.left_out
    assert [json.loads(line)["session_id"] for line in out.read_text().splitlines()] == ids
