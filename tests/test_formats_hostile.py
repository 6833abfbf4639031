"""Hostile and random input to every parser: it fails only with the hub's errors, and
what it stores holds what was sent."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from app import formats
from app.config import LimitsConfig
from app.domain import StepType, Trace
from app.errors import HubError, Unexportable
from app.ingest.ingestor import NUL_STORED_AS, Preparer
from tests.support.format_examples import (
    BATCH_RUNNER,
    ENVIRONMENT,
    EXAMPLES,
    NATIVE,
)
from tests.support.hostile import FORMATS, MB, adversarial, five_kb_native

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
            # A chat training record needs an assistant turn (and, for chat templates,
            # arguments that are a JSON object).
            assert target in ("openai", "messages")
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
    children: Iterable[tuple[Any, Any]]
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
    swapped: dict[str, Any] = example
    return swapped


_LIMITS = st.builds(
    LimitsConfig,
    max_steps_per_trace=st.integers(min_value=1, max_value=8),
    max_step_chars=st.integers(min_value=1, max_value=200),
    max_json_depth=st.integers(min_value=2, max_value=12),
) | st.just(LimitsConfig())


def _prepare_fails_only_with_hub_errors(body: Any, fmt: str | None, limits: LimitsConfig) -> None:
    """Beyond the parsers: the limits, scoring, filters and token count that ingest runs
    on every item refuse bad input only with a HubError, and what they accept is a row
    the database can store (JSON that orjson writes)."""
    try:
        row = Preparer(ENVIRONMENT, limits).row(body, fmt)
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


def test_a_native_trace_parses_to_its_steps_as_sent() -> None:
    """Each step in its place with its text whole, and the body left as it was. (How
    fast: bench/formats_hostile.py.)"""
    item = five_kb_native()
    sent = copy.deepcopy(item)
    trace = formats.parse(item)
    assert item == sent
    assert [(s.type.value, s.content, s.call_id) for s in trace.steps] == [
        (s["type"], s.get("content"), s.get("call_id")) for s in sent["steps"]]


def test_arguments_that_are_not_an_object_are_kept_for_scoring() -> None:
    """An agent that sent an array or a number as arguments made an invalid tool call:
    the trace is stored and `invalid_tool_call` scores it, rather than a 422."""
    trace = formats.parse({"messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "a", "arguments": 4}}]},
    ]})
    assert [s.arguments for s in trace.steps if s.type == "action"] == [4]


# --- hostile text ------------------------------------------------------------


def _texts(fmt: str, body: dict[str, Any]) -> list[tuple[str, str | None]]:
    """The canonical steps (type, content) the hostile body of `fmt` makes: every text
    in its place, no tag left open made into a call or a result of its own."""
    if fmt == "sharegpt":
        _, gpt, tool = (turn["value"] for turn in body["conversations"])
        return [("final", gpt), ("observation", tool)]
    if fmt == "openai":
        # Its think blocks are blank, which say nothing (Hermes pads turns with them):
        # the answer is the text outside them, the stray close tag it starts with.
        tool = body["messages"][2]["content"]
        return [("final", "</think>"), ("observation", tool)]
    if fmt == "atif":
        agent = body["steps"][1]
        return [("final", agent["message"]),
                ("observation", agent["observation"]["results"][0]["content"])]
    return [(step["type"], step.get("content")) for step in body["steps"]]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_hostile_megabyte_is_stored_whole(fmt: str, start_hub: Any, tmp_path: Path) -> None:
    """Through the real ingest path, each format's megabyte of its parser's worst text
    (tags that never close, near-duplicate thoughts) is stored: the original as sent,
    and the trajectory with every text in its place. A parser whose work grows with the
    square of its input (a 144 KB ShareGPT turn of "<tool_call> " once took 49 s) runs
    past limits.max_item_seconds, which refuses the item. How long a hostile megabyte
    takes beside one of prose: bench/formats_hostile.py."""
    hub = start_hub({"storage_backend": "sqlite", "db_path": str(tmp_path / "t.db")},
                    "--no-workers", limits={"max_step_chars": 2 * MB})
    body = adversarial(fmt)
    sent = orjson.dumps(body)
    assert len(sent) > 0.9 * MB
    with hub.client() as client:
        r = client.post("/v1/traces", content=sent, headers={"content-type": "application/json"})
        assert r.status_code == 202, r.text[:300]
        trace_id = r.json()["trace_id"]
        original = client.get(f"/v1/traces/{trace_id}", params={"view": "original"})
        canonical = client.get(f"/v1/traces/{trace_id}")
    assert original.json()["trace"] == body
    steps = canonical.json()["trace"]["steps"]
    assert [(step["type"], step.get("content")) for step in steps] == _texts(fmt, body)


def _nul_replaced(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("\x00", NUL_STORED_AS)
    if isinstance(value, dict):
        return {_nul_replaced(k): _nul_replaced(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nul_replaced(v) for v in value]
    return value
