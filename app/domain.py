"""The canonical trace every input format is normalised into, and the pipeline stages.

Scoring, filtering, compression and export read only these types, so a rule behaves
the same whether the agent wrote native steps, OpenAI messages, ShareGPT or ATIF.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field


class StepType(StrEnum):
    THOUGHT = "thought"
    ACTION = "action"
    OBSERVATION = "observation"
    MESSAGE = "message"
    FINAL = "final"


class Status(StrEnum):
    """The task's outcome as the agent reported it."""

    SUCCESS = "success"
    FAILURE = "failure"
    TIMEOUT = "timeout"
    ERROR = "error"
    UNKNOWN = "unknown"


class Stage(StrEnum):
    """Where a trace is in the pipeline.

    received -> rejected | accepted -> compressed | compression_skipped -> batched
    -> delivered. Failures are states of their own, with the error kept on the row.
    """

    RECEIVED = "received"
    REJECTED = "rejected"
    ACCEPTED = "accepted"
    COMPRESSED = "compressed"
    COMPRESSION_SKIPPED = "compression_skipped"
    COMPRESSION_FAILED = "compression_failed"
    BELOW_THRESHOLD = "below_threshold"
    BATCHED = "batched"
    DELIVERED = "delivered"


# Allowed moves; a stage move is `UPDATE ... WHERE stage = :expected` against this table.
TRANSITIONS: dict[Stage, frozenset[Stage]] = {
    Stage.RECEIVED: frozenset({Stage.ACCEPTED, Stage.REJECTED}),
    Stage.ACCEPTED: frozenset(
        {
            Stage.COMPRESSED,
            Stage.COMPRESSION_SKIPPED,
            Stage.COMPRESSION_FAILED,
            Stage.BELOW_THRESHOLD,
            Stage.BATCHED,
            Stage.REJECTED,
        }
    ),
    Stage.COMPRESSED: frozenset({Stage.BATCHED, Stage.BELOW_THRESHOLD, Stage.REJECTED}),
    Stage.COMPRESSION_SKIPPED: frozenset({Stage.BATCHED, Stage.BELOW_THRESHOLD, Stage.REJECTED}),
    Stage.COMPRESSION_FAILED: frozenset({Stage.ACCEPTED}),
    Stage.BELOW_THRESHOLD: frozenset({Stage.ACCEPTED}),
    Stage.REJECTED: frozenset({Stage.ACCEPTED}),
    Stage.BATCHED: frozenset({Stage.DELIVERED}),
    Stage.DELIVERED: frozenset(),
}


def can_move(current: Stage, target: Stage) -> bool:
    return target in TRANSITIONS[current]


class BatchState(StrEnum):
    """Where a batch is in its delivery.

    pending: formed, waiting for (or in) delivery; `attempts` counts the tries and a
      lease names the worker delivering it.
    delivered: the target acknowledged it (once; `delivered_at` says when).
    failed: every attempt failed; `last_error` says why. `atropos batches retry ID`
      makes it pending again.
    """

    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"


BATCH_TRANSITIONS: dict[BatchState, frozenset[BatchState]] = {
    BatchState.PENDING: frozenset({BatchState.DELIVERED, BatchState.FAILED}),
    BatchState.FAILED: frozenset({BatchState.PENDING}),
    BatchState.DELIVERED: frozenset(),
}


class Label(StrEnum):
    """A reviewer's verdict on a trace. A `bad` trace is never batched."""

    GOOD = "good"
    BAD = "bad"


class Step(BaseModel):
    """One step of a trajectory.

    - thought: `content` is the reasoning.
    - action: `tool`, `arguments` (a JSON object, or the raw string the agent wrote when
      it did not parse as one), `call_id`; `content` may hold text said with the call.
    - observation: `call_id`, `content`, `error` (the error text, None when the tool
      succeeded), `exit_code`.
    - message: `role` (system, user, assistant) and `content`.
    - final: `content` is the final answer.
    """

    model_config = ConfigDict(extra="forbid")

    type: StepType
    content: str | None = None
    role: str | None = None
    tool: str | None = None
    arguments: Any = None
    call_id: str | None = None
    error: str | None = None
    exit_code: int | None = None


class Agent(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    model: str | None = None


class Outcome(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status: Status = Status.UNKNOWN
    code_runs_ok: bool | None = None
    # Why the status is what it is, in the source's own words (e.g. "max iteration").
    reason: str | None = None


class Trace(BaseModel):
    """The canonical trace: what every format becomes, and what exports start from."""

    model_config = ConfigDict(extra="forbid")

    trace_id: str | None = None
    task: str = ""
    agent: Agent = Field(default_factory=Agent)
    env: str | None = None
    policy_version: str | None = None
    # Tool names the agent was offered, when the source declares them; None = unknown.
    tools: list[str] | None = None
    steps: list[Step] = Field(default_factory=list)
    outcome: Outcome = Field(default_factory=Outcome)
    metadata: dict[str, Any] = Field(default_factory=dict)
    # The format the trace arrived in (native, openai, sharegpt, atif, or an import source).
    source_format: str = "native"

    def text_parts(self) -> list[str]:
        """The text that `total_tokens` counts: task, messages, thoughts, tool names and
        arguments, observations and the final answer."""
        parts = [self.task] if self.task else []
        for step in self.steps:
            if step.content:
                parts.append(step.content)
            if step.type is StepType.ACTION:
                if step.tool:
                    parts.append(step.tool)
                if step.arguments is not None:
                    parts.append(
                        step.arguments
                        if isinstance(step.arguments, str)
                        else _compact_json(step.arguments)
                    )
            if step.error and step.error != step.content:
                parts.append(step.error)
        return parts


def _compact_json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
