"""`atropos rescore`: score stored traces again with the current reward rules and
filters, for when a user changes the weights. `atropos recompress`: compress stored
traces again with the current compression policy (`recompress`, below).

Traces whose `scored_with` fingerprint differs from the current environment's are
rescored in batches, oldest first, one transaction per batch; a run that is stopped
resumes where it stopped (the finished traces carry the new fingerprint).

Traces stored before the hub kept the environment's reward (revision 0006) have no
`env_reward` and may carry a status the parsers then inferred from that reward (reward
> 0 was "success"). Rescoring reads their outcome again (`reported_outcome`): from the
item as received, through today's parser, or, for imports, from what the adapter kept
in metadata; then `env_reward`, `status` and the stored traces' outcome are updated with
the scores. A reviewer's
reward override outlives a rescore: the breakdown is new, the reward stays the override.
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app import formats
from app.cli.options import Commands, add_since, command
from app.cli.progress import Progress
from app.compression import Compressed, compress
from app.config import CompressionConfig, load_compression, load_config
from app.db.migrate import database
from app.db.models import MEMBERS, PAYLOADS, REVIEWS, TRACES, WITH_PAYLOADS
from app.db.moves import TRACE_STAGES
from app.db.types import utcnow
from app.domain import Outcome, Stage, Trace
from app.errors import HubError
from app.evaluation.environment import Environment
from app.import_sources import fireact
from app.import_sources._common import env_reward

BATCH = 500
# Traces already handed to training keep their stage; only their scores change.
SENT = {Stage.BATCHED, Stage.DELIVERED}


def new_stage(stage: Stage, rejected: bool) -> Stage:
    if stage in SENT:
        return stage
    if rejected:
        return Stage.REJECTED
    # Un-rejected, or under a threshold that the new reward may pass: back to the
    # start of the background stages, which decide again.
    if stage in (Stage.REJECTED, Stage.BELOW_THRESHOLD):
        return Stage.ACCEPTED
    return stage


async def pending(engine: AsyncEngine, environment: Environment, since: datetime | None) -> int:
    async with engine.connect() as conn:
        count = await conn.scalar(sa.select(sa.func.count()).where(*_todo(environment, since)))
        return int(count or 0)


async def rescore(
    engine: AsyncEngine,
    environment: Environment,
    *,
    since: datetime | None = None,
    on_batch: Callable[[int], None] = lambda n: None,
) -> Counter[str]:
    """Returns counts: rescored, the stage moves made (e.g. "accepted->rejected"), and
    the outcomes read again (traces stored before the environment's reward was kept)."""
    counts: Counter[str] = Counter()
    after: tuple[datetime, str] | None = None
    while True:
        async with engine.begin() as conn:
            c, p = TRACES.c, PAYLOADS.c
            unfilled = c.env_reward.is_(None)
            query = (
                sa.select(
                    c.trace_id, c.created_at, c.stage, p.trace,
                    # Read only where the environment's reward may still be missing.
                    sa.case((unfilled, p.original)).label("original"),
                    sa.case((unfilled, p.compressed)).label("compressed"),
                    REVIEWS.c.reward.label("override"),
                )
                .select_from(WITH_PAYLOADS.outerjoin(REVIEWS))
                .where(*_todo(environment, since))
            )
            if after is not None:
                query = query.where(sa.tuple_(c.created_at, c.trace_id) > after)
            rows = (await conn.execute(query.order_by(c.created_at, c.trace_id).limit(BATCH))).all()
            if not rows:
                return counts
            # One statement per (stage, new stage): each row is updated only if it is
            # still in the stage it was read in (a stage may have moved it since).
            moves: dict[tuple[Stage, Stage], list[_Update]] = defaultdict(list)
            for row in rows:
                update = _update(row, environment, counts)
                moves[Stage(row.stage), update.stage].append(update)
            for (source, target), updates in moves.items():
                stmt = (TRACE_STAGES.move(target, expected=[source]) if target != source
                        else sa.update(TRACES).where(c.stage == source.value))
                await conn.execute(
                    stmt.where(c.trace_id == sa.bindparam("b_id"))
                    .values(reward=sa.bindparam("reward"),
                            env_reward=sa.bindparam("env_reward"),
                            status=sa.bindparam("status"),
                            reward_breakdown=sa.bindparam("reward_breakdown"),
                            reject_reasons=sa.bindparam("reject_reasons"),
                            scored_with=environment.fingerprint,
                            updated_at=utcnow()),
                    [u.scores for u in updates],
                )
                # The stored traces get the outcome read again, so that exports and
                # batches say what the columns say. The stage was just set to `target`.
                reread = [u.payloads for u in updates if u.payloads is not None]
                if reread:
                    moved = sa.select(c.trace_id).where(c.trace_id == p.trace_id,
                                                        c.stage == target.value)
                    await conn.execute(
                        sa.update(PAYLOADS)
                        .where(p.trace_id == sa.bindparam("b_id"), moved.exists())
                        .values(trace=sa.bindparam("trace"),
                                compressed=sa.bindparam("compressed")),
                        reread,
                    )
        after = (rows[-1].created_at, rows[-1].trace_id)
        on_batch(len(rows))


def _todo(environment: Environment, since: datetime | None) -> list[sa.ColumnElement[bool]]:
    where = [sa.or_(TRACES.c.scored_with.is_(None),
                    TRACES.c.scored_with != environment.fingerprint)]
    if since is not None:
        where.append(TRACES.c.created_at >= since)
    return where


@dataclass(frozen=True, slots=True)
class _Update:
    stage: Stage
    scores: dict[str, Any]
    # The canonical and compressed traces with the outcome read again; None: unchanged.
    payloads: dict[str, Any] | None


def _update(row: Any, environment: Environment, counts: Counter[str]) -> _Update:
    """The trace's new stage and scores, and its payloads when the outcome changed."""
    trace = Trace.model_validate(row.trace)
    outcome = reported_outcome(trace, row.original)
    evaluation = environment.evaluate(trace.model_copy(update={"outcome": outcome}))
    stage = new_stage(Stage(row.stage), bool(evaluation.reject_reasons))
    counts["rescored"] += 1
    if stage != row.stage:
        counts[f"{row.stage}->{stage}"] += 1
    scores = {
        "b_id": row.trace_id,
        "env_reward": outcome.reward,
        "status": outcome.status.value,
        "reward": evaluation.reward if row.override is None else row.override,
        "reward_breakdown": evaluation.breakdown,
        "reject_reasons": evaluation.reject_reasons,
    }
    if outcome == trace.outcome:
        return _Update(stage, scores, None)
    counts["outcomes read again"] += 1
    payloads = {
        "b_id": row.trace_id,
        "trace": _with_outcome(row.trace, outcome),
        "compressed": _with_outcome(row.compressed, outcome),
    }
    return _Update(stage, scores, payloads)


# Imports are stored as native traces; before revision 0006 the adapters kept the
# environment's reward in metadata (and inferred a status from it).
_IMPORTED_REWARD: dict[str, Callable[[Trace], float | None]] = {
    "tau_bench": lambda trace: env_reward(trace.metadata.get("reward")),
    "atropos_group": lambda trace: env_reward(trace.metadata.get("score")),
    "fireact": lambda trace: fireact.verdict_outcome(trace.outcome.reason).reward,
}


def reported_outcome(trace: Trace, original: Any) -> Outcome:
    """The trace's outcome as today's parsers read it: unchanged when it carries the
    environment's reward; else read again from `original` (the item as received, None
    when not loaded) or, for an import, from what its adapter kept in metadata."""
    if trace.outcome.reward is not None:
        return trace.outcome
    imported = trace.metadata.get("imported_from")
    source = imported.get("format") if isinstance(imported, dict) else None
    if isinstance(source, str):
        read = _IMPORTED_REWARD.get(source)
        reward = None if read is None else read(trace)
        if reward is None:
            return trace.outcome
        # The status those adapters wrote was inferred from this very reward.
        return Outcome(code_runs_ok=trace.outcome.code_runs_ok, reward=reward)
    if original is None or trace.source_format == "native":
        return trace.outcome  # native traces could not carry a reward before 0006
    try:
        return formats.parse(original, trace.source_format).outcome
    except HubError:  # an original today's parser refuses: keep what was stored
        return trace.outcome


def _with_outcome(payload: dict[str, Any] | None, outcome: Outcome) -> dict[str, Any] | None:
    """A stored trace (canonical or compressed) with `outcome`; None stays None."""
    if payload is None:
        return None
    return {**payload, "outcome": outcome.model_dump(mode="json", exclude_none=True)}


# --- the command ----------------------------------------------------------------


def register(commands: Commands[argparse.ArgumentParser]) -> None:
    parser = command(commands, "rescore", _rescore,
                     help="score stored traces with the current rules",
                     example="atropos rescore --config config.json --since 7d")
    add_since(parser)
    parser = command(commands, "recompress", _recompress,
                     help="compress stored traces again with the current compression policy",
                     example="atropos recompress --config config.json "
                             "--compression compression.json")
    parser.add_argument("--compression", help="compression.json (default: the defaults)")
    add_since(parser)


async def _rescore(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    environment = Environment.from_config(config.environment)
    async with database(config) as engine:
        todo = await pending(engine, environment, args.since)
        if todo == 0:
            print(await _nothing_to_do(engine, environment, args.since))
            return 0
        progress = Progress("rescored", todo)
        counts = await rescore(engine, environment, since=args.since, on_batch=progress.advance)
        progress.close()
    print(f"rescored: {counts.pop('rescored', 0)}")
    for key, n in sorted(counts.items()):
        print(f"stage {key}: {n}" if "->" in key else f"{key}: {n}")
    return 0


async def _nothing_to_do(engine: AsyncEngine, environment: Environment,
                         since: datetime | None) -> str:
    """Why no trace needed rescoring, in one line."""
    window = "" if since is None else f" since {since.isoformat(timespec='seconds')}"
    query = sa.select(sa.func.count()).select_from(TRACES)
    if since is not None:
        query = query.where(TRACES.c.created_at >= since)
    async with engine.connect() as conn:
        stored = int(await conn.scalar(query) or 0)
    if stored == 0:
        return f"nothing to rescore: no traces stored{window}"
    return (f"nothing to rescore: all {stored} traces{window} are already scored with the "
            f"current reward rules and filters (environment {environment.fingerprint[:12]}); "
            "change environment.reward_rules or invalid_trace_filters in the config to "
            "score them differently")


# --- recompress -----------------------------------------------------------------

# Traces past the compression stage keep their stage: the sent ones, and those the
# threshold held back (which an export or a rescore may still reach).
_PAST_COMPRESSION = {*SENT, Stage.BELOW_THRESHOLD}
# Traces that went through compression.
_COMPRESSION_DONE = (Stage.COMPRESSED, Stage.COMPRESSION_SKIPPED, *_PAST_COMPRESSION)


@dataclass
class Recompressed:
    """What `recompress` did: counts (read, changed, unchanged, and per kind of change),
    and the batches that hold an old version of a changed trace (batch id -> traces)."""

    counts: Counter[str]
    old_in_batches: dict[str, int]


async def recompress(
    engine: AsyncEngine,
    policy: CompressionConfig,
    max_trace_tokens: int,
    *,
    since: datetime | None = None,
    on_batch: Callable[[int], None] = lambda n: None,
) -> Recompressed:
    """Compress every trace that went through compression again, with key_decision_extract
    under `policy`, oldest first, a transaction per batch of traces. A trace whose new
    compression differs from the stored one gets it (not batched yet: moving between
    compressed and compression_skipped as the result says; batched, delivered or below
    the threshold: the stage stays, and the batches of the sent ones are listed, since
    they hold the old version). Traces
    summarized by the model are left as they are: recompressing them would need a
    model call per trace."""
    extract = policy.model_copy(update={"strategy": "key_decision_extract"})
    counts: Counter[str] = Counter()
    sent_changed: list[str] = []
    after: tuple[datetime, str] | None = None
    c, p = TRACES.c, PAYLOADS.c
    while True:
        query = sa.select(
            c.trace_id, c.created_at, c.stage, p.trace, c.total_tokens, p.compressed,
            c.compression, c.reward, c.reward_breakdown,
        ).select_from(WITH_PAYLOADS).where(c.stage.in_([s.value for s in _COMPRESSION_DONE]))
        if since is not None:
            query = query.where(c.created_at >= since)
        if after is not None:
            query = query.where(sa.tuple_(c.created_at, c.trace_id) > after)
        async with engine.begin() as conn:
            rows = (await conn.execute(query.order_by(c.created_at, c.trace_id).limit(BATCH))).all()
            if not rows:
                break
            for row in rows:
                counts["read"] += 1
                if (row.compression or {}).get("strategy") == "summarize_middle":
                    counts["left as the model summarized them"] += 1
                    continue
                result = await compress(
                    Trace.model_validate(row.trace), row.total_tokens, extract,
                    forced=row.total_tokens > max_trace_tokens,
                    reward=row.reward, breakdown=row.reward_breakdown,
                )
                done = isinstance(result, Compressed)
                values: dict[str, Any] = (
                    {"compressed": result.trace.model_dump(mode="json", exclude_none=True),
                     "compressed_tokens": result.tokens_after, "compression": result.record()}
                    if isinstance(result, Compressed) else
                    {"compressed": None, "compressed_tokens": None,
                     "compression": {"skipped": result.reason}}
                )
                if values["compressed"] == row.compressed:
                    counts["unchanged"] += 1
                    continue
                stage = Stage(row.stage)
                if not await _store(conn, row.trace_id, stage, done, values):
                    counts["moved on meanwhile, left"] += 1
                    continue
                counts["changed"] += 1
                counts[("compressed again" if row.compressed is not None and done
                        else "now compressed" if done else "now kept whole")] += 1
                if stage in SENT:
                    sent_changed.append(row.trace_id)
        after = (rows[-1].created_at, rows[-1].trace_id)
        on_batch(len(rows))
    return Recompressed(counts, await _batches_holding(engine, sent_changed))


async def _store(conn: Any, trace_id: str, stage: Stage, done: bool,
                 values: dict[str, Any]) -> bool:
    """Write a trace's new compression, if it is still in `stage`; a trace not yet
    batched moves to the stage its new result calls for (through accepted, the one
    way the stage machine allows between the two)."""
    target = (stage if stage in _PAST_COMPRESSION
              else Stage.COMPRESSED if done else Stage.COMPRESSION_SKIPPED)
    where = TRACES.c.trace_id == trace_id
    compressed = values.pop("compressed")
    if target == stage:
        update = sa.update(TRACES).where(where, TRACES.c.stage == stage.value)
        written = await conn.execute(update.values(updated_at=utcnow(), **values))
        if written.rowcount != 1:
            return False
    else:
        back = await conn.execute(
            TRACE_STAGES.move(Stage.ACCEPTED, expected=[stage]).where(where))
        if back.rowcount != 1:
            return False
        await conn.execute(TRACE_STAGES.move(target, expected=[Stage.ACCEPTED]).where(where)
                           .values(**values))
    await conn.execute(sa.update(PAYLOADS).where(PAYLOADS.c.trace_id == trace_id)
                       .values(compressed=compressed))
    return True


async def _batches_holding(engine: AsyncEngine, trace_ids: list[str]) -> dict[str, int]:
    found: Counter[str] = Counter()
    async with engine.connect() as conn:
        for start in range(0, len(trace_ids), BATCH):
            chunk = trace_ids[start : start + BATCH]
            rows = await conn.execute(
                sa.select(MEMBERS.c.batch_id, sa.func.count().label("n"))
                .where(MEMBERS.c.trace_id.in_(chunk)).group_by(MEMBERS.c.batch_id))
            found.update({row.batch_id: row.n for row in rows})
    return dict(sorted(found.items()))


async def _recompress(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    policy = load_compression(args.compression).compression
    async with database(config) as engine:
        progress = Progress("recompressed", None)
        done = await recompress(engine, policy, config.trace_server.max_trace_tokens,
                                since=args.since, on_batch=progress.advance)
        progress.close()
    counts = done.counts
    print(f"recompressed: {counts.pop('read', 0)} traces read, {counts.pop('changed', 0)} "
          f"changed, {counts.pop('unchanged', 0)} unchanged")
    for key, n in sorted(counts.items()):
        print(f"  {key}: {n}")
    if done.old_in_batches:
        held = ", ".join(f"{batch} ({n})" for batch, n in done.old_in_batches.items())
        print(f"batches holding old versions of changed traces ({len(done.old_in_batches)}, "
              f"traces in each): {held}")
    else:
        print("batches holding old versions of changed traces: none")
    return 0
