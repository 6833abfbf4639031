"""The success bodies of every route: what `/openapi.json` promises a client.

Two ways a route answers, one per kind of route:

- The /v1 routes but POST /v1/traces, and the ops routes, return their model (the return
  annotation, as in full-stack-fastapi-template); FastAPI validates it and pydantic-core
  writes the JSON, so a body cannot drift from its schema unnoticed.
- The hot paths, POST /v1/traces and POST /scored_data(_list), render their JSON
  themselves (thousands of answers a second), built as TypedDicts that are also their
  schemas: `IngestResult` (app/ingest/inserter.py), `IngestResults` here, `Error`
  (app/errors.py), `GroupReceived` and `GroupsReceived` (app/atropos/models.py). mypy
  checks what is built against the type the document is made from.
- The Atropos routes that answer the bytes atroposlib's clients expect (a 128-bit
  trainer uuid, batches joined from stored JSON, keys absent rather than null) declare
  their model for the document only (`response_model=`).
  tests/test_openapi.py checks the bodies of the last two kinds against the document.

Errors have their one shape, `Error` (app/errors.py), which app/api/openapi.py declares.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from typing_extensions import TypedDict  # pydantic needs this one on 3.11

from app.atropos.models import ScoredData
from app.db.trace_queries import View
from app.domain import MAX_REWARD, BatchState, Label, Stage, Status
from app.errors import Error
from app.evaluation.filters import RejectReason
from app.evaluation.scoring import RuleResult
from app.ingest.inserter import IngestResult
from app.runs import RunStatus

# Timestamps are written by the services as `datetime.isoformat()` (UTC, "+00:00");
# kept as strings so the bytes stay what they were.
Timestamp = Annotated[str, WithJsonSchema({"type": "string", "format": "date-time"})]


# --- traces ------------------------------------------------------------------------


class IngestResults(TypedDict):
    """A batch or NDJSON body's answer: one per item, in the order sent."""

    results: Annotated[list[IngestResult | Error], Field(
        description="Each item's result, or its error; one bad item does not fail the others")]


class ReviewBody(BaseModel):
    """POST /v1/traces/{trace_id}/review: a verdict on the trace; a later one replaces it."""

    model_config = ConfigDict(extra="forbid")

    label: Label = Field(description="good, or bad (a bad trace is never batched)")
    note: str | None = Field(None, max_length=10_000, description="Why, for other reviewers")
    reward: float | None = Field(
        None,
        allow_inf_nan=False,
        ge=-MAX_REWARD,
        le=MAX_REWARD,
        description="Overrides the computed reward (the threshold and exports use it); "
        "omitted: the computed reward stands",
    )


class Review(BaseModel):
    label: Label
    note: str | None
    reward: float | None = Field(description="The reward override; null when none")
    reviewer: str = Field(description="The name of the API key that reviewed (anonymous with "
                          "auth off)")
    reviewed_at: Timestamp


class ReviewSaved(Review):
    trace_id: str
    stage: Stage = Field(description="The trace's stage now (a trace already batched stays so)")
    trace_reward: float | None = Field(description="The trace's reward now")


class ReviewClaim(BaseModel):
    """The review queue's answer: the next trace to review, held for this reviewer."""

    trace_id: str | None = Field(description="null when no unreviewed trace matches")
    expires_at: Timestamp | None = Field(description="Until when no other reviewer gets it")


class TraceSummary(BaseModel):
    """A trace in a listing: its columns, without the payloads."""

    trace_id: str
    created_at: Timestamp = Field(description="When it was stored (UTC)")
    stage: Stage
    status: Status
    total_tokens: int = Field(description="Tokens of the canonical trace (cl100k_base)")
    compressed_tokens: int | None = Field(
        description="Tokens of the compressed trace, once compressed"
    )
    reward: float | None
    env_reward: float | None = Field(
        description="The environment's own reward as the agent sent it; null when none"
    )
    reject_reasons: list[RejectReason]
    format: str = Field(
        description="The format it arrived in (native, openai, sharegpt, atif, ...)"
    )
    env: str | None = Field(description="The environment it was collected in")
    model: str | None = Field(description="The policy model")
    agent: str | None = Field(description="The agent's name")
    policy_version: str | None
    label: Label | None = Field(description="A reviewer's label; null when not reviewed")


class TracePage(BaseModel):
    """In the order asked for (`sort`; newest first by default)."""

    traces: list[TraceSummary]
    next_cursor: str | None = Field(
        description="Pass as `cursor` for the next page; null on the last"
    )


class TraceRecord(TraceSummary):
    """One trace with its scores and one view of its payload."""

    updated_at: Timestamp
    reward_breakdown: dict[str, RuleResult] | None
    compression: dict[str, Any] | None = Field(
        description="What compression did (strategy, tokens_before, tokens_after, target, ratio, "
        "removed, over_limit, fallback), or {skipped: reason}; null before compression"
    )
    stage_error: str | None = Field(
        description="The last failure of a background stage on this trace"
    )
    review: Review | None = Field(description="A reviewer's verdict; null when not reviewed")
    batch_id: str | None = Field(description="The batch it went into; null when not batched")
    view: View = Field(description="Which payload `trace` holds")
    trace: Any = Field(
        description="canonical: the trace every format is normalised into; original: the item as "
        "received; compressed: the compressed canonical trace (SFT only)"
    )


# --- batches -----------------------------------------------------------------------


class BatchRecord(BaseModel):
    """A batch of exactly distributor.batch_size traces, and its delivery."""

    batch_id: str = Field(description="The idempotency key towards the target")
    state: BatchState
    size: int = Field(description="How many traces it holds")
    target: str = Field(description="The distributor target it goes to (jsonl, http, tinker, ...)")
    format: str = Field(description="The format its traces are written in")
    attempts: int = Field(description="Delivery attempts since it was formed or last retried")
    last_error: str | None = Field(description="Why the last attempt failed")
    created_at: Timestamp
    updated_at: Timestamp
    delivered_at: Timestamp | None = Field(description="When the target acknowledged it")
    receipt: dict[str, Any] | None = Field(
        description="What the target reported (file, HTTP status, training job)"
    )


class BatchDetail(BatchRecord):
    trace_ids: list[str] = Field(description="Its traces, in batch order")


class BatchPage(BaseModel):
    """Newest first."""

    batches: list[BatchRecord]
    next_cursor: str | None = Field(
        description="Pass as `cursor` for the next page; null on the last"
    )


# --- ops ---------------------------------------------------------------------------


class Health(BaseModel):
    status: Literal["ok"] = Field(description="The process answers")


_FAILING = (
    "What the hub depends on that is failing now (the database, the ingest processes, "
    "the summary model, the training service) -> what its last failure said"
)


class Ready(BaseModel):
    status: Literal["ready"]
    schema_revision: str = Field(description="The database's migration revision (the head)")
    failing: dict[str, str] = Field(default_factory=dict, description=_FAILING)


class NotReady(BaseModel):
    status: Literal["unavailable"]
    reason: str = Field(description="The database is unreachable, or its schema is not at the head")
    failing: dict[str, str] = Field(default_factory=dict, description=_FAILING)


class BatchCounts(BaseModel):
    """Batches by delivery state."""

    pending: int
    delivered: int
    failed: int
    total: int


class CompressionCounts(BaseModel):
    compressed: int = Field(description="Traces compressed (those that moved on since included)")
    skipped: int = Field(description="Traces that compression left whole")
    failed: int = Field(description="Traces in compression_failed")
    fallbacks: int = Field(
        description="Traces compressed with key_decision_extract in place of summarize_middle "
        "(the model failing, or nothing to summarize: each record's `fallback` says why)"
    )
    mean_ratio: float | None = Field(description="Mean compressed_tokens / total_tokens")


class RewardBucket(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    low: float = Field(alias="from", description="The bucket's lowest reward (inclusive)")
    high: float = Field(alias="to", description="The bucket's upper bound (exclusive)")
    traces: int


class OtlpRefusal(BaseModel):
    reason: str = Field(description="Why the traces make no trajectory, naming the service "
                        "and what its sender should change")
    traces: int


class GatewayCounts(BaseModel):
    """Gateway rollouts by assembly state (docs/gateway.md), and their calls."""

    open_rollouts: int = Field(description="Rollouts with calls their trajectory does not hold yet")
    assembled_rollouts: int = Field(description="Rollouts made into a trajectory")
    refused_rollouts: int = Field(description="Rollouts whose calls make no trajectory (see "
                                  "the log for why)")
    calls: int = Field(description="Model calls captured")
    late_changes: int = Field(description="Calls and finishes that came after the rollout's "
                              "trajectory was batched: kept, not used")


class OtlpCounts(BaseModel):
    """OTLP traces by assembly state (docs/otlp.md), and their spans."""

    open_traces: int = Field(description="Traces with spans their trajectory does not hold yet")
    assembled_traces: int = Field(description="Traces made into a trajectory")
    refused_traces: int = Field(
        description="Traces whose spans make no trajectory (`refusals` says why)"
    )
    refusals: list[OtlpRefusal] = Field(
        default_factory=list,
        description="The reasons traces were refused, the commonest first (at most 20)")
    spans: int = Field(description="Spans received (each once)")
    late_spans: int = Field(
        description="Spans that arrived after their trajectory was batched: kept, not used"
    )


class EnvRewardStats(BaseModel):
    traces: int = Field(description="Traces that carry the environment's own reward")
    mean: float | None = Field(description="Its mean over them")


class AtroposEnvPresence(BaseModel):
    env_id: int
    name: str
    connected: bool
    counting: bool = Field(
        description="Counts for weights and minimum allocations: heard from within "
        "atropos.env_timeout_seconds"
    )
    last_seen: Timestamp = Field(description="When the env was last heard from (UTC)")


class HubEnvStats(BaseModel):
    pending: int = Field(description="Rollouts waiting for their group to fill")
    grouped: int = Field(description="Rollouts in a group that entered the queue")
    groups: int = Field(description="Groups the hub formed and queued")
    dropped: dict[str, int] = Field(
        description="Rollouts left out, by reason: unusable (no tokens or no score), "
        "too_long (past the trainer's max_token_len), stale (past "
        "distributor.max_policy_lag), same_scores (a group whose scores are all equal), "
        "timed_out (short of group_size at group_timeout_seconds, group_timeout drop)")


class AtroposStats(BaseModel):
    envs: list[AtroposEnvPresence]
    step: int = Field(description="The trainer's step (atroposlib's current_step)")
    groups_received: int = Field(
        description="Groups posted to /scored_data and /scored_data_list, ever"
    )
    groups_waiting: dict[str, int] = Field(
        description="Groups not yet served, by state: buffered (smaller than their env's "
        "group_size), queued, batched (in a formed batch)"
    )
    queue_bytes: int = Field(description="JSON bytes of the groups waiting")
    hub_env: HubEnvStats = Field(
        description="Trajectories delivered to the `atropos` target as rollouts of the "
        "hub's own groups")


class TraceStats(BaseModel):
    """Counts over every stored trace and batch."""

    traces: int = Field(description="Traces stored")
    by_stage: dict[str, int] = Field(description="Traces by pipeline stage")
    by_status: dict[str, int] = Field(description="Traces by reported status")
    total_tokens: int
    compressed_tokens: int
    mean_reward: float | None
    env_reward: EnvRewardStats
    batches: BatchCounts
    compression: CompressionCounts
    rejections_by_filter: dict[str, int] = Field(
        description="Rejected traces, by the filter that failed"
    )
    rule_firings: dict[str, int] = Field(description="Traces on which each reward rule fired")
    redactions: dict[str, int] = Field(
        description="Secrets replaced with [REDACTED:<kind>] before storing, by kind"
    )
    reward_histogram: list[RewardBucket]
    otlp: OtlpCounts
    gateway: GatewayCounts
    atropos: AtroposStats = Field(description="The Atropos API's registered envs")


# --- runs --------------------------------------------------------------------------


class RunCreated(BaseModel):
    run_id: str
    status: RunStatus


class RunProcess(BaseModel):
    """A process of a run (the trainer, then each environment), in start order."""

    role: str = Field(description="trainer, or env-N")
    command: list[str]
    pid: int | None
    exit_code: int | None
    log_path: str = Field(description="Its stdout and stderr, on the hub's machine")
    started_at: Timestamp | None
    healthy_at: Timestamp | None = Field(description="When its health check first passed")
    exited_at: Timestamp | None
    # Present only when asked for: GET /v1/runs/{run_id}?tail=N.
    log_tail: list[str] | None = Field(
        None, description="The last `tail` lines of its log, secrets redacted"
    )


class Run(BaseModel):
    run_id: str
    status: RunStatus
    error_message: str | None = Field(
        description="Why it failed: which process, its exit code, its log"
    )
    created_at: Timestamp
    started_at: Timestamp | None
    finished_at: Timestamp | None
    host: str = Field(description="The machine its processes run on")
    spec: dict[str, Any] = Field(description="The RunSpec it was started with")
    processes: list[RunProcess]


class RunList(BaseModel):
    runs: list[Run]


# --- the Atropos API (atroposlib 0.4.0's answers, key for key) ---------------------


class AtroposRoot(BaseModel):
    message: Literal["AtroposLib API"]


class TrainerRegistered(BaseModel):
    uuid: int = Field(description="The trainer's id (a 128-bit integer)")


class EnvRegistered(BaseModel):
    status: Literal["success"]
    env_id: int
    wandb_name: str
    checkpoint_dir: str
    starting_step: int
    checkpoint_interval: int | None
    num_steps: int


class WaitForTrainer(BaseModel):
    """No trainer has fetched a batch yet: register again later."""

    status: Literal["wait for trainer to start"]


class EnvDisconnected(BaseModel):
    status: Literal["success", "failure"]
    error: str | None = Field(None, description="Present on failure: no env with that env_id")


class TrainerBatch(BaseModel):
    batch: list[ScoredData] | None = Field(
        description="The groups of the next batch; null when none is ready"
    )
    batch_id: str | None = Field(
        None, description="Present with ?ack=1: confirm it with POST /batch/ack"
    )


class TrainerNotRegistered(BaseModel):
    status: Literal["error"]
    message: str
    batch: list[Any]


class BatchAcked(BaseModel):
    status: Literal["acked"]
    batch_id: str
    duplicate: bool = Field(description="True when it had been acknowledged before")


class NoExample(BaseModel):
    """What atroposlib answers before any group has arrived: every list empty."""

    tokens: list[Any]
    masks: list[Any]
    scores: list[Any]
    advantages: list[Any]
    ref_logprobs: list[Any]
    generation_params: list[Any]
    inference_logprobs: list[Any]
    messages: list[Any]
    images: list[Any]


class AtroposStatus(BaseModel):
    current_step: int
    queue_size: int = Field(description="Groups in the queue")


class AtroposEnvStatus(BaseModel):
    current_step: int
    queue_size: int = Field(description="Groups this env can count on for the next batch")
    unallocated_fraction: float
    self_queue_size: int = Field(description="This env's own groups in the queue")
    max_group_size: int
    env_weight: float
    last_seen: Timestamp | None = Field(
        None, description="When this env was last heard from (UTC)"
    )


class AtroposInfo(BaseModel):
    batch_size: int
    max_token_len: int


class WandbInfo(BaseModel):
    group: str | None
    project: str | None


class RolloutFinish(BaseModel):
    """POST /v1/rollouts/{rollout_id}/finish: the rollout is over (its trajectory is
    made now); a later finish replaces this one (a reward that arrives late)."""

    model_config = ConfigDict(extra="forbid")

    reward: float | None = Field(None, allow_inf_nan=False,
                                 description="The environment's reward: the trace's env_reward")
    status: Status | None = Field(None, description="The task's outcome")
    task: str | None = Field(None, description="The task, when not the first user message")
    group: str | None = Field(
        None, max_length=200,
        description="The group of rollouts it belongs to (metadata.group): the `atropos` "
                    "target groups by it instead of by task")
    metadata: dict[str, Any] | None = Field(None, description="Kept in the trace's metadata")


class RolloutFinished(BaseModel):
    rollout_id: str
    trace_id: str = Field(description="The trajectory's id: GET /v1/traces/{trace_id}")
    calls: int = Field(description="Calls captured for the rollout so far")


class TokenView(BaseModel):
    """GET /v1/traces/{id}?view=tokens, for a gateway trajectory (docs/gateway.md)."""

    tokens: list[int]
    masks: list[int] = Field(description="-100 except on generated positions (the token id)")
    logprobs: list[float | None] = Field(description="One per position: the upstream's on "
                                         "generated positions, 1.0 elsewhere")
    exact: bool = Field(description="Every call's prompt ids begin with the previous call's "
                        "prompt and completion ids")
    broken_at: int | None = Field(None, description="The first call that breaks the chain")
    samples: list[dict[str, Any]] | None = Field(
        None, description="Each call's prompt ids, completion ids and logprobs (when not exact)")
