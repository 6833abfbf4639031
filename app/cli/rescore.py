"""`atropos rescore`: score stored traces again with the current reward rules and
filters, for when a user changes the weights.

Traces whose `scored_with` fingerprint differs from the current environment's are
rescored in batches, oldest first, one transaction per batch; a run that is stopped
resumes where it stopped (the finished traces carry the new fingerprint). A reviewer's
reward override outlives a rescore: the breakdown is new, the reward stays the override.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.cli.options import Commands, add_since, command
from app.cli.progress import Progress
from app.config import load_config
from app.db.models import REVIEWS, TRACES
from app.db.types import utcnow
from app.domain import Stage, Trace
from app.evaluation.environment import Environment
from app.hub import database

BATCH = 500
# Traces already handed to training keep their stage; only their scores change.
SENT = {Stage.BATCHED.value, Stage.DELIVERED.value}


def new_stage(stage: str, rejected: bool) -> str:
    if stage in SENT:
        return stage
    if rejected:
        return Stage.REJECTED.value
    # Un-rejected, or under a threshold that the new reward may pass: back to the
    # start of the background stages, which decide again.
    if stage in (Stage.REJECTED.value, Stage.BELOW_THRESHOLD.value):
        return Stage.ACCEPTED.value
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
            query = (
                sa.select(TRACES.c.trace_id, TRACES.c.created_at, TRACES.c.stage,
                          TRACES.c.trace, REVIEWS.c.reward.label("override"))
                .select_from(TRACES.outerjoin(REVIEWS))
                .where(*_todo(environment, since))
            )
            if after is not None:
                query = query.where(sa.tuple_(TRACES.c.created_at, TRACES.c.trace_id) > after)
            rows = (await conn.execute(
                query.order_by(TRACES.c.created_at, TRACES.c.trace_id).limit(BATCH)
            )).all()
            if not rows:
                return counts
            updates = [_update(row, environment, counts) for row in rows]
            await conn.execute(
                sa.update(TRACES)
                .where(TRACES.c.trace_id == sa.bindparam("b_id"),
                       TRACES.c.stage == sa.bindparam("b_stage"))
                .values(reward=sa.bindparam("reward"),
                        reward_breakdown=sa.bindparam("reward_breakdown"),
                        reject_reasons=sa.bindparam("reject_reasons"),
                        scored_with=environment.fingerprint,
                        stage=sa.bindparam("stage"),
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


def _update(row: Any, environment: Environment, counts: Counter[str]) -> dict[str, Any]:
    evaluation = environment.evaluate(Trace.model_validate(row.trace))
    stage = new_stage(row.stage, bool(evaluation.reject_reasons))
    counts["rescored"] += 1
    if stage != row.stage:
        counts[f"{row.stage}->{stage}"] += 1
    return {
        "b_id": row.trace_id,
        "b_stage": row.stage,
        "reward": evaluation.reward if row.override is None else row.override,
        "reward_breakdown": evaluation.breakdown,
        "reject_reasons": evaluation.reject_reasons,
        "stage": stage,
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
