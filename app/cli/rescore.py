"""`atropos rescore`: score stored traces again with the current reward rules and
filters, for when a user changes the weights.

Traces whose `scored_with` fingerprint differs from the current environment's are
rescored in batches, oldest first, one transaction per batch; a run that is stopped
resumes where it stopped (the finished traces carry the new fingerprint).
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from collections.abc import Callable
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.cli.options import Commands, add_since, command
from app.cli.progress import Progress
from app.config import load_config
from app.db.models import TRACES
from app.db.moves import TRACE_STAGES
from app.db.types import utcnow
from app.domain import Stage, Trace
from app.evaluation.environment import Environment
from app.hub import database

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
    """Returns counts: rescored, and the stage moves made (e.g. "accepted->rejected")."""
    counts: Counter[str] = Counter()
    after: tuple[datetime, str] | None = None
    while True:
        async with engine.begin() as conn:
            query = sa.select(TRACES.c.trace_id, TRACES.c.created_at, TRACES.c.stage,
                              TRACES.c.trace).where(*_todo(environment, since))
            if after is not None:
                query = query.where(sa.tuple_(TRACES.c.created_at, TRACES.c.trace_id) > after)
            rows = (await conn.execute(
                query.order_by(TRACES.c.created_at, TRACES.c.trace_id).limit(BATCH)
            )).all()
            if not rows:
                return counts
            # One statement per (stage, new stage): each row is updated only if it is
            # still in the stage it was read in (a stage may have moved it since).
            moves: dict[tuple[Stage, Stage], list[dict[str, Any]]] = defaultdict(list)
            for row in rows:
                stage, update = _update(row, environment, counts)
                moves[Stage(row.stage), stage].append(update)
            for (source, target), updates in moves.items():
                stmt = (TRACE_STAGES.move(target, expected=[source]) if target != source
                        else sa.update(TRACES).where(TRACES.c.stage == source.value))
                await conn.execute(
                    stmt.where(TRACES.c.trace_id == sa.bindparam("b_id"))
                    .values(reward=sa.bindparam("reward"),
                            reward_breakdown=sa.bindparam("reward_breakdown"),
                            reject_reasons=sa.bindparam("reject_reasons"),
                            scored_with=environment.fingerprint,
                            updated_at=utcnow()),
                    updates,
                )
        after = (rows[-1].created_at, rows[-1].trace_id)
        on_batch(len(rows))


def _todo(environment: Environment, since: datetime | None) -> list[sa.ColumnElement[bool]]:
    where = [sa.or_(TRACES.c.scored_with.is_(None),
                    TRACES.c.scored_with != environment.fingerprint)]
    if since is not None:
        where.append(TRACES.c.created_at >= since)
    return where


def _update(
    row: Any, environment: Environment, counts: Counter[str]
) -> tuple[Stage, dict[str, Any]]:
    """The trace's new stage, and its new scores."""
    evaluation = environment.evaluate(Trace.model_validate(row.trace))
    stage = new_stage(Stage(row.stage), bool(evaluation.reject_reasons))
    counts["rescored"] += 1
    if stage != row.stage:
        counts[f"{row.stage}->{stage}"] += 1
    return stage, {
        "b_id": row.trace_id,
        "reward": evaluation.reward,
        "reward_breakdown": evaluation.breakdown,
        "reject_reasons": evaluation.reject_reasons,
    }


# --- the command ----------------------------------------------------------------


def register(commands: Commands[argparse.ArgumentParser]) -> None:
    parser = command(commands, "rescore", _rescore,
                     help="score stored traces with the current rules")
    add_since(parser)


async def _rescore(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    environment = Environment.from_config(config.environment)
    async with database(config) as engine:
        progress = Progress("rescored", await pending(engine, environment, args.since))
        counts = await rescore(engine, environment, since=args.since, on_batch=progress.advance)
        progress.close()
    print(f"rescored: {counts.pop('rescored', 0)}")
    for move, n in sorted(counts.items()):
        print(f"stage {move}: {n}")
    return 0
