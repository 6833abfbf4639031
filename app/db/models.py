"""SQLAlchemy models. Alembic (migrations/) owns the schema; these mirror it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from app.db.types import JSON_, UtcTimeStamp

# Stable constraint names, so that migrations can refer to them on both dialects.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


# SQLite makes only an INTEGER PRIMARY KEY an alias of the rowid (and so
# autoincrementing); PostgreSQL wants the wider type.
_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


class TraceRow(Base):
    """One trajectory. The column names are a public interface: users query them
    with sqlite3/psql directly (DESIGN §3)."""

    __tablename__ = "traces"

    trace_id: Mapped[str] = mapped_column(sa.String(200), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UtcTimeStamp)
    updated_at: Mapped[datetime] = mapped_column(UtcTimeStamp)
    status: Mapped[str] = mapped_column(sa.String(16))
    stage: Mapped[str] = mapped_column(sa.String(32))
    total_tokens: Mapped[int] = mapped_column(sa.Integer)
    compressed_tokens: Mapped[int | None] = mapped_column(sa.Integer)
    reward: Mapped[float | None] = mapped_column(sa.Float)
    # The scalar reward the environment sent with the trace (outcome.reward); NULL when
    # none. It enters `reward` through environment.env_reward.
    env_reward: Mapped[float | None] = mapped_column(sa.Float)
    reward_breakdown: Mapped[dict[str, Any] | None] = mapped_column(JSON_)
    reject_reasons: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON_)
    # Fingerprint of the rules and filters that scored it; `atropos rescore` redoes
    # the traces whose fingerprint differs from the current config's.
    scored_with: Mapped[str | None] = mapped_column(sa.String(16))
    # Filters for listing, copied out of the canonical trace.
    source_format: Mapped[str] = mapped_column(sa.String(32))
    env: Mapped[str | None] = mapped_column(sa.String(200))
    model: Mapped[str | None] = mapped_column(sa.String(200))
    agent_name: Mapped[str | None] = mapped_column(sa.String(200))
    policy_version: Mapped[str | None] = mapped_column(sa.String(200))
    # The group of rollouts it belongs to (metadata.group): an Atropos group an env
    # sent, or one a trainer's rollouts were given.
    group_id: Mapped[str | None] = mapped_column(sa.String(200))
    # sha256 of the item as received: a resent trace_id is a duplicate only if it matches.
    content_hash: Mapped[str] = mapped_column(sa.String(64))
    # What compression did (its payload, the compressed trace, is in trace_payloads).
    compression: Mapped[dict[str, Any] | None] = mapped_column(JSON_)
    # Background stages: a lease on the row, retries counted, the last failure kept.
    stage_error: Mapped[str | None] = mapped_column(sa.Text)
    attempts: Mapped[int] = mapped_column(sa.Integer, server_default="0")
    lease_owner: Mapped[str | None] = mapped_column(sa.String(64))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UtcTimeStamp)

    __table_args__ = (
        sa.Index("ix_traces_stage_created_at", "stage", "created_at"),
        # The trace list's orders and its filters in time order (0010).
        sa.Index("ix_traces_created_at_trace_id", "created_at", "trace_id"),
        sa.Index("ix_traces_status_created_at", "status", "created_at"),
        sa.Index("ix_traces_env_created_at", "env", "created_at"),
        sa.Index("ix_traces_model_created_at", "model", "created_at"),
        sa.Index("ix_traces_reward_trace_id", "reward", "trace_id"),
        sa.Index("ix_traces_total_tokens_trace_id", "total_tokens", "trace_id"),
        sa.Index("ix_traces_group_id_created_at", "group_id", "created_at"),
    )


# The Core table, for the set-based statements (group insert, claims, stage moves).
TRACES: sa.Table = TraceRow.__table__  # type: ignore[assignment]


class TracePayloadRow(Base):
    """A trace's payloads: the item as received, the canonical trace, and (never in
    place of either) the compressed trace. Written with the trace (and compressed by
    its stage), never moved: apart from `traces`, whose rows every stage move
    rewrites, so that a move writes a narrow row (0025)."""

    __tablename__ = "trace_payloads"

    trace_id: Mapped[str] = mapped_column(
        sa.String(200), sa.ForeignKey("traces.trace_id", ondelete="CASCADE"), primary_key=True
    )
    original: Mapped[Any] = mapped_column(JSON_)
    trace: Mapped[dict[str, Any]] = mapped_column(JSON_)
    compressed: Mapped[dict[str, Any] | None] = mapped_column(JSON_)


PAYLOADS: sa.Table = TracePayloadRow.__table__  # type: ignore[assignment]
PAYLOAD_COLUMNS = ("original", "trace", "compressed")
# A trace with its payloads, for the reads that want both.
WITH_PAYLOADS = TRACES.join(PAYLOADS, PAYLOADS.c.trace_id == TRACES.c.trace_id)


class BatchRow(Base):
    """A batch of exactly distributor.batch_size passing traces, and its delivery.

    `batch_id` is the idempotency key towards the target. `receipt` is what the target
    reported (file, HTTP status, training job), kept as delivery goes so that a
    redelivery resumes a training job instead of starting a second one."""

    __tablename__ = "batches"

    batch_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UtcTimeStamp, index=True)
    updated_at: Mapped[datetime] = mapped_column(UtcTimeStamp)
    size: Mapped[int] = mapped_column(sa.Integer)
    target: Mapped[str] = mapped_column(sa.String(16))
    format: Mapped[str] = mapped_column(sa.String(16))
    state: Mapped[str] = mapped_column(sa.String(16))
    attempts: Mapped[int] = mapped_column(sa.Integer, server_default="0")
    lease_owner: Mapped[str | None] = mapped_column(sa.String(64))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UtcTimeStamp)
    last_error: Mapped[str | None] = mapped_column(sa.Text)
    delivered_at: Mapped[datetime | None] = mapped_column(UtcTimeStamp)
    receipt: Mapped[dict[str, Any] | None] = mapped_column(JSON_)

    __table_args__ = (sa.Index("ix_batches_state_created_at", "state", "created_at"),)


class BatchTraceRow(Base):
    """Membership: the primary key on trace_id is what keeps a trace out of two batches."""

    __tablename__ = "batch_traces"

    trace_id: Mapped[str] = mapped_column(
        sa.String(200), sa.ForeignKey("traces.trace_id", ondelete="CASCADE"), primary_key=True
    )
    batch_id: Mapped[str] = mapped_column(
        sa.String(64), sa.ForeignKey("batches.batch_id", ondelete="CASCADE"), index=True
    )
    position: Mapped[int] = mapped_column(sa.Integer)


# Core tables for the batch statements (formation, claims, acknowledgement).
BATCHES: sa.Table = BatchRow.__table__  # type: ignore[assignment]
MEMBERS: sa.Table = BatchTraceRow.__table__  # type: ignore[assignment]


class ReviewRow(Base):
    """A person's verdict on a trace (app/db/review_queries.py): one per trace, the latest wins.
    `reward`, when set, overrides the computed reward: it is what `traces.reward`
    holds while the review stands."""

    __tablename__ = "reviews"

    trace_id: Mapped[str] = mapped_column(
        sa.String(200), sa.ForeignKey("traces.trace_id", ondelete="CASCADE"), primary_key=True
    )
    label: Mapped[str] = mapped_column(sa.String(8), index=True)
    note: Mapped[str | None] = mapped_column(sa.Text)
    reward: Mapped[float | None] = mapped_column(sa.Float)
    reviewer: Mapped[str] = mapped_column(sa.String(200))  # the API key's name
    reviewed_at: Mapped[datetime] = mapped_column(UtcTimeStamp)


class ReviewClaimRow(Base):
    """The review queue's lease on a trace: served to `holder` until `expires_at`."""

    __tablename__ = "review_claims"

    trace_id: Mapped[str] = mapped_column(
        sa.String(200), sa.ForeignKey("traces.trace_id", ondelete="CASCADE"), primary_key=True
    )
    holder: Mapped[str] = mapped_column(sa.String(200), index=True)
    expires_at: Mapped[datetime] = mapped_column(UtcTimeStamp)


class TraceSearchRow(Base):
    """The searchable text of a trace (task and final answer, lowercased), and the two
    as written for the trace list to show, written with the trace (app/db/search.py),
    so that neither a search nor the list reads the payloads."""

    __tablename__ = "trace_search"

    id: Mapped[int] = mapped_column(_BIG_ID, primary_key=True, autoincrement=True)
    trace_id: Mapped[str] = mapped_column(
        sa.String(200), sa.ForeignKey("traces.trace_id", ondelete="CASCADE"), unique=True
    )
    text: Mapped[str] = mapped_column(sa.Text)
    task: Mapped[str] = mapped_column(sa.Text, server_default="")
    final_answer: Mapped[str | None] = mapped_column(sa.Text)


REVIEWS: sa.Table = ReviewRow.__table__  # type: ignore[assignment]
REVIEW_CLAIMS: sa.Table = ReviewClaimRow.__table__  # type: ignore[assignment]
TRACE_SEARCH: sa.Table = TraceSearchRow.__table__  # type: ignore[assignment]


class RunRow(Base):
    """One training run (app/runs): a trainer and its environments, started, watched
    and stopped by the hub. The injected model channel (keys, URLs) is never stored."""

    __tablename__ = "runs"

    run_id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    status: Mapped[str] = mapped_column(sa.String(16), index=True)
    created_at: Mapped[datetime] = mapped_column(UtcTimeStamp, index=True)
    updated_at: Mapped[datetime] = mapped_column(UtcTimeStamp)
    started_at: Mapped[datetime | None] = mapped_column(UtcTimeStamp)
    finished_at: Mapped[datetime | None] = mapped_column(UtcTimeStamp)
    error_message: Mapped[str | None] = mapped_column(sa.Text)
    # The run spec as accepted (commands, cwd, env, health checks, intervals).
    spec: Mapped[dict[str, Any]] = mapped_column(JSON_)
    # Process ids mean something on one machine only: the host whose hub started the run.
    host: Mapped[str] = mapped_column(sa.String(255))
    # The hub process watching the run ("host:pid:start_ticks"); NULL when none is.
    supervisor: Mapped[str | None] = mapped_column(sa.String(255))


class RunProcessRow(Base):
    """One process of a run: position 0 is the trainer, 1.. the environments."""

    __tablename__ = "run_processes"

    run_id: Mapped[str] = mapped_column(
        sa.String(32), sa.ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True
    )
    position: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    role: Mapped[str] = mapped_column(sa.String(16))
    command: Mapped[list[str]] = mapped_column(JSON_)
    log_path: Mapped[str] = mapped_column(sa.Text)
    # pid and start time (clock ticks after boot, /proc/<pid>/stat) together name the
    # process: a pid alone may have been reused by the time a restarted hub looks.
    pid: Mapped[int | None] = mapped_column(sa.Integer)
    start_ticks: Mapped[int | None] = mapped_column(sa.BigInteger)
    started_at: Mapped[datetime | None] = mapped_column(UtcTimeStamp)
    healthy_at: Mapped[datetime | None] = mapped_column(UtcTimeStamp)
    exited_at: Mapped[datetime | None] = mapped_column(UtcTimeStamp)
    exit_code: Mapped[int | None] = mapped_column(sa.Integer)


RUNS: sa.Table = RunRow.__table__  # type: ignore[assignment]
RUN_PROCESSES: sa.Table = RunProcessRow.__table__  # type: ignore[assignment]


# --- the Atropos trajectory API (app/atropos) -------------------------------------

class AtroposStateRow(Base):
    """The run: what the trainer registered, whether it has started, and the step.

    Exactly one row (id 1), created by the migration; /reset_data resets it in place.
    """

    __tablename__ = "atropos_state"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    registered: Mapped[bool] = mapped_column(sa.Boolean, server_default=sa.false())
    started: Mapped[bool] = mapped_column(sa.Boolean, server_default=sa.false())
    # The uuid /register answered last (an int of 128 bits: wider than BIGINT).
    trainer_uuid: Mapped[str | None] = mapped_column(sa.String(40))
    wandb_group: Mapped[str | None] = mapped_column(sa.Text)
    wandb_project: Mapped[str | None] = mapped_column(sa.Text)
    batch_size: Mapped[int] = mapped_column(sa.Integer, server_default="-1")
    max_token_len: Mapped[int] = mapped_column(sa.Integer, server_default="-1")
    checkpoint_dir: Mapped[str | None] = mapped_column(sa.Text)
    save_checkpoint_interval: Mapped[int | None] = mapped_column(sa.Integer)
    starting_step: Mapped[int | None] = mapped_column(sa.Integer)
    num_steps: Mapped[int] = mapped_column(sa.Integer, server_default="-1")
    step: Mapped[int] = mapped_column(sa.BigInteger, server_default="0")
    # Groups deleted (served, or by /reset_data): with the rows still stored, every
    # group ever received.
    groups_dropped: Mapped[int] = mapped_column(sa.BigInteger, server_default="0")
    updated_at: Mapped[datetime | None] = mapped_column(UtcTimeStamp)


class AtroposEnvRow(Base):
    """A registered environment. env_id is its position in registration order."""

    __tablename__ = "atropos_envs"

    env_id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=False)
    desired_name: Mapped[str] = mapped_column(sa.Text)
    real_name: Mapped[str] = mapped_column(sa.Text)
    weight: Mapped[float] = mapped_column(sa.Float)
    max_token_length: Mapped[int] = mapped_column(sa.Integer)
    # Raised by /status-env when the env's groups in the queue are larger.
    group_size: Mapped[int] = mapped_column(sa.Integer)
    min_batch_allocation: Mapped[float | None] = mapped_column(sa.Float)
    connected: Mapped[bool] = mapped_column(sa.Boolean)
    registered_at: Mapped[datetime] = mapped_column(UtcTimeStamp)
    # When the env was last heard from (registration, /scored_data, /scored_data_list,
    # /status-env): an env silent for atropos.env_timeout_seconds stops counting.
    last_seen_at: Mapped[datetime] = mapped_column(UtcTimeStamp)
    # The env the hub registers for the groups it forms from trajectories
    # (distributor.target atropos): at most one.
    hub_owned: Mapped[bool] = mapped_column(sa.Boolean, server_default=sa.false())


class AtroposSegmentRow(Base):
    """A group's JSON as the env sent it (normalised as atroposlib does), raw-deflated
    (app/atropos/segments.py): served as stored, inflated or spliced into a gzip
    answer. Written once, never updated: a group's state changes on its small row in
    atropos_groups (SQLite rewrites a whole row, overflow pages and all, on any
    UPDATE)."""

    __tablename__ = "atropos_segments"

    id: Mapped[int] = mapped_column(_BIG_ID, primary_key=True, autoincrement=True)
    deflated: Mapped[bytes] = mapped_column(sa.LargeBinary)
    crc32: Mapped[int] = mapped_column(sa.BigInteger)  # of the JSON, for the gzip trailer


class AtroposGroupRow(Base):
    """One scored group.

    state: buffered (an odd-size group waiting for others of its env) -> queued ->
    batched (in a formed batch) -> served. The id order is the queue order (a group
    released from a buffer gets a new row); a served group is deleted, with its
    segment, unless it is the latest example.
    """

    __tablename__ = "atropos_groups"

    id: Mapped[int] = mapped_column(_BIG_ID, primary_key=True, autoincrement=True)
    state: Mapped[str] = mapped_column(sa.String(16))
    env_id: Mapped[int | None] = mapped_column(sa.Integer)
    size: Mapped[int] = mapped_column(sa.Integer)  # sequences in the group
    bytes: Mapped[int] = mapped_column(sa.Integer)  # length of the JSON
    # The env sent no inference_logprobs: filled when serving only if
    # atropos.fill_missing_logprobs is on.
    fill_logprobs: Mapped[bool] = mapped_column(sa.Boolean)
    segment_id: Mapped[int] = mapped_column(_BIG_ID, sa.ForeignKey("atropos_segments.id"))
    created_at: Mapped[datetime] = mapped_column(UtcTimeStamp)

    __table_args__ = (
        # Covers the queue scans (formation, /status, /status-env, the bound).
        sa.Index("ix_atropos_groups_state_id", "state", "id", "env_id", "size", "bytes"),
        sa.Index("ix_atropos_groups_state_env_id", "state", "env_id"),
        # Deleting a segment checks that no group still refers to it.
        sa.Index("ix_atropos_groups_segment_id", "segment_id"),
    )


class AtroposBatchRow(Base):
    """A formed batch: exactly batch_size sequences of whole groups.

    state: pending -> served (GET /batch) or pending -> leased (GET /batch?ack=1)
    -> acked, or back to pending when the lease expires. Pending batches are served
    highest `seq` first, as atroposlib pops its list of formed batches.
    """

    __tablename__ = "atropos_batches"

    id: Mapped[int] = mapped_column(_BIG_ID, primary_key=True, autoincrement=True)
    seq: Mapped[int] = mapped_column(sa.BigInteger)
    state: Mapped[str] = mapped_column(sa.String(16))
    group_ids: Mapped[list[int]] = mapped_column(JSON_)  # in batch order
    sequences: Mapped[int] = mapped_column(sa.Integer)
    lease_id: Mapped[str | None] = mapped_column(sa.String(32), unique=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UtcTimeStamp)
    deliveries: Mapped[int] = mapped_column(sa.Integer, server_default="0")
    created_at: Mapped[datetime] = mapped_column(UtcTimeStamp)
    updated_at: Mapped[datetime] = mapped_column(UtcTimeStamp)

    __table_args__ = (sa.Index("ix_atropos_batches_state_seq", "state", "seq"),)


class AtroposRolloutRow(Base):
    """A trajectory delivered to the `atropos` target, as a sequence of a group of the
    hub's own env (app/atropos/hub_env.py).

    state: pending (waiting for its group to fill) -> grouped (in a group that entered
    the queue) or dropped (`reason` says why: unusable, too_long, stale, same_scores,
    timed_out). A trajectory has one row (trace_id is the key), so it is in at most
    one group.
    """

    __tablename__ = "atropos_rollouts"

    trace_id: Mapped[str] = mapped_column(sa.String(200), primary_key=True)
    group_key: Mapped[str] = mapped_column(sa.Text)
    state: Mapped[str] = mapped_column(sa.String(16))
    reason: Mapped[str | None] = mapped_column(sa.String(32))
    detail: Mapped[str | None] = mapped_column(sa.Text)
    score: Mapped[float | None] = mapped_column(sa.Float)
    tokens: Mapped[int] = mapped_column(sa.Integer)  # the sequence's length
    # The policy_version when it is a step number (the gateway stamps the trainer's).
    policy_step: Mapped[int | None] = mapped_column(sa.BigInteger)
    # {"tokens", "masks", "logprobs", "messages", "exact"}: what the group holds.
    rollout: Mapped[dict[str, Any]] = mapped_column(JSON_)
    group_id: Mapped[str | None] = mapped_column(sa.String(64))
    created_at: Mapped[datetime] = mapped_column(UtcTimeStamp)
    grouped_at: Mapped[datetime | None] = mapped_column(UtcTimeStamp)
    # The hub's env its group was queued under (or dropped for same scores by): its
    # env_id then (a /reset_data may give that id to another env since) and name.
    env_id: Mapped[int | None] = mapped_column(sa.Integer)
    env: Mapped[str | None] = mapped_column(sa.String(200))

    __table_args__ = (
        sa.Index("ix_atropos_rollouts_state_group_key", "state", "group_key"),
        sa.Index("ix_atropos_rollouts_group_id", "group_id"),
        sa.Index("ix_atropos_rollouts_env_grouped_at", "env", "grouped_at"),
    )


class AtroposEnvGroupRow(Base):
    """A group an env sent (/scored_data, /scored_data_list), waiting to become
    trajectories (app/stages/env_groups.py). Its segment is kept until then, even once
    the group is served."""

    __tablename__ = "atropos_env_groups"

    segment_id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True,
                                            autoincrement=False)
    env_id: Mapped[int | None] = mapped_column(sa.Integer)
    step: Mapped[int] = mapped_column(sa.BigInteger)  # the trainer's, when it arrived
    received_at: Mapped[datetime] = mapped_column(UtcTimeStamp)


ATROPOS_ENV_GROUPS: sa.Table = AtroposEnvGroupRow.__table__  # type: ignore[assignment]
ATROPOS_ROLLOUTS: sa.Table = AtroposRolloutRow.__table__  # type: ignore[assignment]
ATROPOS_STATE: sa.Table = AtroposStateRow.__table__  # type: ignore[assignment]
ATROPOS_ENVS: sa.Table = AtroposEnvRow.__table__  # type: ignore[assignment]
ATROPOS_GROUPS: sa.Table = AtroposGroupRow.__table__  # type: ignore[assignment]
ATROPOS_SEGMENTS: sa.Table = AtroposSegmentRow.__table__  # type: ignore[assignment]
ATROPOS_BATCHES: sa.Table = AtroposBatchRow.__table__  # type: ignore[assignment]


class ApiKeyRow(Base):
    """An API key (app/access/keys.py). Only the sha256 of its secret is kept: the key itself
    is shown once, by `atropos keys create`."""

    __tablename__ = "api_keys"

    key_id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(200))
    scopes: Mapped[list[str]] = mapped_column(JSON_)
    secret_hash: Mapped[str] = mapped_column(sa.String(64))
    created_at: Mapped[datetime] = mapped_column(UtcTimeStamp)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcTimeStamp)


API_KEYS: sa.Table = ApiKeyRow.__table__  # type: ignore[assignment]


class DashboardSessionRow(Base):
    """A person signed in at the dashboard (app/access/sessions.py): the cookie holds a
    random id, this row its sha256, the key it was opened with and until when it opens
    the dashboard."""

    __tablename__ = "dashboard_sessions"

    session_hash: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    key_id: Mapped[str] = mapped_column(
        sa.String(32), sa.ForeignKey("api_keys.key_id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(UtcTimeStamp)
    expires_at: Mapped[datetime] = mapped_column(UtcTimeStamp, index=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcTimeStamp)


DASHBOARD_SESSIONS: sa.Table = DashboardSessionRow.__table__  # type: ignore[assignment]


class ScheduledTaskRow(Base):
    """When a periodic task (retention) last ran, so that several hub processes run it
    once per period between them, and a restart does not run it again early."""

    __tablename__ = "scheduled_tasks"

    name: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    last_started_at: Mapped[datetime] = mapped_column(UtcTimeStamp)
    last_finished_at: Mapped[datetime | None] = mapped_column(UtcTimeStamp)
    last_result: Mapped[dict[str, Any] | None] = mapped_column(JSON_)


SCHEDULED_TASKS: sa.Table = ScheduledTaskRow.__table__  # type: ignore[assignment]


# --- OTLP spans waiting to become trajectories (app/ingest/otlp) --------------------


class OtlpSpanRow(Base):
    """One span as received over OTLP, kept until its trajectory is batched (a
    re-assembly reads every span again; a span resent by an exporter is stored once).
    The payloads are the OTLP protobuf encoding, secrets redacted: cheap to store,
    decoded into OTLP/JSON only when the trace is assembled."""

    __tablename__ = "otlp_spans"

    trace_id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)  # 32 hex digits
    span_id: Mapped[str] = mapped_column(sa.String(16), primary_key=True)  # 16 hex digits
    start_ns: Mapped[int] = mapped_column(sa.BigInteger)  # start time, Unix nanoseconds
    # The ResourceSpans (resource, schema_url) and ScopeSpans (scope, schema_url) the
    # span came in, without their children; the span itself.
    resource: Mapped[bytes] = mapped_column(sa.LargeBinary)
    scope: Mapped[bytes] = mapped_column(sa.LargeBinary)
    span: Mapped[bytes] = mapped_column(sa.LargeBinary)
    # Secrets replaced in these before they were stored, by kind (null: none); summed
    # into the trajectory's metadata.redactions.
    redactions: Mapped[dict[str, int] | None] = mapped_column(JSON_)


class OtlpTraceRow(Base):
    """A trace's assembly: what has arrived, and what the assembly stage made of it.

    state (app/ingest/otlp/store.py TraceState): open (spans the trajectory does not
    hold yet; due once its root span has ended and otlp.quiet_seconds passed without a
    span, or otlp.max_wait_seconds after the first one) -> assembled (the trajectory,
    under the same trace_id in `traces`, holds them) -> sent (it was batched or deleted;
    its spans are deleted here, and spans arriving later are kept and counted in
    late_spans) | refused (the spans make no trajectory; `error` says why) -> dropped
    (their spans deleted, otlp.max_wait_seconds after the last). A new span reopens it.
    A bare client's model call (a trace that is one model-call span) has `continues`:
    the digest of its messages and answer, which the next call of its conversation
    begins with (app/formats/stitching.py); a call that continues another's is
    `joined` to the trace whose trajectory holds them all, and makes none of its own."""

    __tablename__ = "otlp_traces"

    trace_id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    state: Mapped[str] = mapped_column(sa.String(16), index=True)
    spans: Mapped[int] = mapped_column(sa.Integer)  # distinct spans received
    seen_spans: Mapped[int] = mapped_column(sa.Integer)  # spans the stage has dealt with
    late_spans: Mapped[int] = mapped_column(sa.Integer)  # arrived after batching
    root_ended: Mapped[bool] = mapped_column(sa.Boolean)  # its root span has arrived
    first_span_at: Mapped[datetime] = mapped_column(UtcTimeStamp)
    last_span_at: Mapped[datetime] = mapped_column(UtcTimeStamp)
    error: Mapped[str | None] = mapped_column(sa.Text)
    continues: Mapped[str | None] = mapped_column(sa.String(64), index=True)
    joined: Mapped[str | None] = mapped_column(sa.String(32), index=True)


class GatewayCallRow(Base):
    """One model call through the gateway (app/gateway), committed before its answer's
    last byte reached the agent: the request as sent (secrets redacted), the answer as
    received (a stream assembled), the token ids and logprobs the upstream returned,
    latency, usage, status. `continues`: the digest of its messages followed by its
    answer, which the next call of the same conversation begins with (stitching)."""

    __tablename__ = "gateway_calls"

    rollout_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    call_id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    started_at: Mapped[datetime] = mapped_column(UtcTimeStamp)
    continues: Mapped[str | None] = mapped_column(sa.String(64), index=True)
    call: Mapped[dict[str, Any]] = mapped_column(JSON_)


class GatewayRolloutRow(Base):
    """A rollout's assembly (app/gateway/store.py RolloutState): open (calls or a finish
    its trajectory does not hold yet; due at once when finished, else after
    gateway.quiet_seconds without a call) -> assembled (the trajectory, the trace
    `rollout_id`, holds them) | refused (`error` says why). A call or a finish reopens
    it; one that comes after the trajectory was batched is counted late."""

    __tablename__ = "gateway_rollouts"

    rollout_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    state: Mapped[str] = mapped_column(sa.String(16), index=True)
    calls: Mapped[int] = mapped_column(sa.Integer)  # calls captured
    # Changes (calls and finishes) received, and those the stage has dealt with.
    changes: Mapped[int] = mapped_column(sa.Integer)
    seen_changes: Mapped[int] = mapped_column(sa.Integer)
    late_changes: Mapped[int] = mapped_column(sa.Integer)
    finished: Mapped[bool] = mapped_column(sa.Boolean)
    # {reward?, status?, task?, metadata?} as POST .../finish sent them (the last one).
    finish: Mapped[dict[str, Any] | None] = mapped_column(JSON_)
    first_call_at: Mapped[datetime] = mapped_column(UtcTimeStamp)
    last_change_at: Mapped[datetime] = mapped_column(UtcTimeStamp)
    error: Mapped[str | None] = mapped_column(sa.Text)


OTLP_SPANS: sa.Table = OtlpSpanRow.__table__  # type: ignore[assignment]
OTLP_TRACES: sa.Table = OtlpTraceRow.__table__  # type: ignore[assignment]
GATEWAY_CALLS: sa.Table = GatewayCallRow.__table__  # type: ignore[assignment]
GATEWAY_ROLLOUTS: sa.Table = GatewayRolloutRow.__table__  # type: ignore[assignment]
