"""The canonical trace every input format is normalised into, and the pipeline stages.

Scoring, filtering, compression and export read only these types, so a rule behaves
the same whether the agent wrote native steps, OpenAI messages, ShareGPT or ATIF.
"""

from __future__ import annotations

import json
import math
from enum import StrEnum
from functools import lru_cache
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator

# The largest reward, in magnitude, the hub takes: an environment's, the sum of the rules
# and the weighted environment reward, a reviewer's override. Far past any reward scale
# RL uses; a number beyond it is a bug in the environment (or an attack on the charts).
MAX_REWARD = 1e6


class StepType(StrEnum):
    THOUGHT = "thought"
    ACTION = "action"
    OBSERVATION = "observation"
    MESSAGE = "message"
    FINAL = "final"


# A member looked up once: StepType.ACTION is a descriptor call (~50 ns), made for every
# step of every trace counted.
_ACTION = StepType.ACTION


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
    -> delivered. Failures are states of their own, with the error kept on the row. A
    trace the stages would pass through with nothing to do, or that its ingest process
    compressed, enters past them (app/ingest/ingestor.py EntryStage).
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


# The moves a trace makes, and the only ones it may (app/db/moves.py refuses others).
# `received` never persists: scoring decides before the row is inserted, so a new
# trace enters as one of TRANSITIONS[RECEIVED]: rejected, accepted, or where the
# compression stage would have moved it: compressed (compressed at ingest, which a
# strategy without model calls is) or compression_skipped, or below_threshold under
# the distributor's threshold.
TRANSITIONS: dict[Stage, frozenset[Stage]] = {
    Stage.RECEIVED: frozenset({
        Stage.ACCEPTED, Stage.REJECTED, Stage.COMPRESSED, Stage.COMPRESSION_SKIPPED,
        Stage.BELOW_THRESHOLD,
    }),
    # The compression stage; a rescore whose filters now match.
    Stage.ACCEPTED: frozenset(
        {Stage.COMPRESSED, Stage.COMPRESSION_SKIPPED, Stage.COMPRESSION_FAILED, Stage.REJECTED}
    ),
    # The distribution stage; a rescore; an OTLP trace assembled again (new spans: a new
    # trajectory, scored again, whose stages start over; app/stages/assembly.py).
    Stage.COMPRESSED: frozenset(
        {Stage.BATCHED, Stage.BELOW_THRESHOLD, Stage.REJECTED, Stage.ACCEPTED}
    ),
    Stage.COMPRESSION_SKIPPED: frozenset(
        {Stage.BATCHED, Stage.BELOW_THRESHOLD, Stage.REJECTED, Stage.ACCEPTED}
    ),
    # A rescore: rejected by the new filters, or (from below_threshold and rejected)
    # back to accepted for the stages to decide again; an OTLP trace assembled again.
    Stage.COMPRESSION_FAILED: frozenset({Stage.REJECTED, Stage.ACCEPTED}),
    Stage.BELOW_THRESHOLD: frozenset({Stage.ACCEPTED, Stage.REJECTED}),
    Stage.REJECTED: frozenset({Stage.ACCEPTED}),
    # Delivery; a rescore changes the scores of these two, never their stage.
    Stage.BATCHED: frozenset({Stage.DELIVERED}),
    Stage.DELIVERED: frozenset(),
}

# Where a trace becomes eligible for a batch: every accepted trace passes through the
# compression stage (which skips it when compression is off).
ELIGIBLE: tuple[Stage, ...] = (Stage.COMPRESSED, Stage.COMPRESSION_SKIPPED)

def below_threshold(reward: float | None, threshold: float) -> bool:
    """A trace the distributor never batches for its reward: under the threshold
    (inclusive: reward >= threshold passes), or without a reward. The distribution
    stage's statement says the same in SQL (app/stages/distribution.py)."""
    return reward is None or reward < threshold


# Never deleted by retention (`atropos prune`, config `retention`): on its way to training.
NEVER_PRUNED: frozenset[Stage] = frozenset({Stage.BATCHED})


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


# A batch is inserted pending; `atropos batches retry` is failed -> pending.
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

    def text_parts(self) -> list[str]:
        """The step's counted text: its content; for an action, the tool name and the
        arguments (compact JSON); an error that is not already the content."""
        parts = [self.content] if self.content else []
        if self.type is _ACTION:
            if self.tool:
                parts.append(self.tool)
            if self.arguments is not None:
                parts.append(
                    self.arguments
                    if isinstance(self.arguments, str)
                    else _compact_json(self.arguments)
                )
        if self.error and self.error != self.content:
            parts.append(self.error)
        return parts


class Agent(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    model: str | None = None


class Outcome(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Only what the trace reported; never inferred from a reward.
    status: Status = Status.UNKNOWN
    code_runs_ok: bool | None = None
    # Why the status is what it is, in the source's own words (e.g. "max iteration").
    reason: str | None = None
    # The scalar reward the environment (its verifier) sent with the trace; None when
    # it sent none. Stored in the `env_reward` column; scored by environment.env_reward.
    reward: float | None = None

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


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
        """The text that `total_tokens` counts: what a chat template would show the
        model, without the template's own markup. In order: the tool list
        (`tools_text`), the task, then every step's `Step.text_parts` (system prompts,
        user and assistant messages, thoughts, tool calls, tool results, the final
        answer). docs/decisions.md, "Token counts", says exactly what is counted."""
        parts = self.context_parts()
        for step in self.steps:
            parts += step.text_parts()
        return parts

    def context_parts(self) -> list[str]:
        """The counted text before the steps: the tool list and the task."""
        tools = self.tools_text()
        return [part for part in (tools, self.task) if part]

    def tools_text(self) -> str:
        """The tools offered to the agent as a chat template lists them in its system
        prompt: each schema the trace carried as JSON (`json.dumps`, as Jinja's
        `tojson` writes it), one per line, and a tool known only by name as its name.
        One part, so that the tool list an agent resends with every trace is tokenized
        once (app/tokens.py remembers long parts)."""
        schemas = self.metadata.get("tool_schemas")
        schemas = schemas if isinstance(schemas, list) else []
        described = {
            inner["name"]
            for schema in schemas
            if isinstance(schema, dict)
            and isinstance(inner := schema.get("function"), dict)
            and isinstance(inner.get("name"), str)
        }
        lines = [_template_json(orjson.dumps(schemas))] if schemas else []
        lines.extend(name for name in self.tools or [] if name not in described)
        return "\n".join(lines)


@lru_cache(maxsize=64)
def _template_json(schemas: bytes) -> str:
    # json.dumps is slower than orjson, whose compact output a template would not
    # write; agents resend the same tool list with every trace, so its text is kept,
    # keyed by the compact bytes.
    return "\n".join(json.dumps(schema, ensure_ascii=False) for schema in orjson.loads(schemas))


def _compact_json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
