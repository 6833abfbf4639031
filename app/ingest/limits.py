"""The per-trace limits of config.json's `limits` section, checked before the costly
work (normalising, counting tokens, scoring) is spent on a trace that will be refused.

`check_item` runs on the decoded JSON before any parsing; `check_trace` on the
normalised trace before tokens are counted. Each refusal names its limit in `field`.
Sizes answer 413; nesting, a matter of shape rather than size, 422.
"""

from __future__ import annotations

from typing import Any

import orjson

from app.config import LimitsConfig
from app.domain import Trace
from app.errors import Invalid, PayloadTooLarge
from app.formats import STEP_LISTS


def check_item(item: Any, limits: LimitsConfig) -> None:
    depth = json_depth(item, limits.max_json_depth)
    if depth > limits.max_json_depth:
        raise Invalid(
            f"the trace's JSON nests deeper than limits.max_json_depth "
            f"({limits.max_json_depth} levels)",
            field="limits.max_json_depth",
        )
    if isinstance(item, dict):
        # Where each format keeps its steps: counted as sent, before they are parsed.
        for key in STEP_LISTS:
            steps = item.get(key)
            if isinstance(steps, list) and len(steps) > limits.max_steps_per_trace:
                raise _too_many_steps(f"{key!r} has {len(steps)} entries", limits)


def check_trace(trace: Trace, limits: LimitsConfig) -> None:
    if len(trace.steps) > limits.max_steps_per_trace:
        raise _too_many_steps(f"the normalised trace has {len(trace.steps)} steps", limits)
    # The task counts as a step: other formats send it as the first user message.
    if len(trace.task or "") > limits.max_step_chars:
        raise _step_too_long(f"the task has {len(trace.task or '')} characters", limits)
    for index, step in enumerate(trace.steps):
        chars = len(step.content or "") + len(step.error or "") + _chars(step.arguments)
        if chars > limits.max_step_chars:
            raise _step_too_long(
                f"step {index} of the normalised trace has {chars} characters", limits
            )


def json_depth(value: Any, stop_after: int) -> int:
    """Nesting depth of decoded JSON (a scalar is 0, `{}` is 1), counted without
    recursion, a level at a time, and only up to `stop_after` + 1: the walk stops once
    that is reached."""
    if not isinstance(value, (dict, list)):
        return 0
    level: list[Any] = [value]
    depth = 0
    while level:
        depth += 1
        if depth > stop_after:
            return depth
        below: list[Any] = []
        for node in level:
            for child in node.values() if isinstance(node, dict) else node:
                # Most values are strings: told apart by their type, before isinstance
                # (a third of the walk's time).
                kind = type(child)
                if kind is dict or kind is list or (
                    kind is not str and isinstance(child, (dict, list))
                ):
                    below.append(child)
        level = below
    return depth


def _chars(arguments: Any) -> int:
    if arguments is None:
        return 0
    if isinstance(arguments, str):
        return len(arguments)
    return len(orjson.dumps(arguments))


def _step_too_long(what: str, limits: LimitsConfig) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"{what}; limits.max_step_chars is {limits.max_step_chars}",
        field="limits.max_step_chars",
    )


def _too_many_steps(what: str, limits: LimitsConfig) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"{what}; limits.max_steps_per_trace is {limits.max_steps_per_trace}",
        field="limits.max_steps_per_trace",
    )
