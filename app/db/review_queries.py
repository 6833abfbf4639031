"""Reviews: a person's label (good/bad), note and reward override on a trace, and the
review queue that hands each reviewer the next unreviewed trace.

What a review changes:
- `traces.reward` holds the override while the review stands (DESIGN §3: "a
  reviewer's override wins"), so the threshold, exports, filters and the seed's SQL
  all read it; a review without a reward puts back the computed one (the sum of the
  stored breakdown). A trace under the threshold whose reward is overridden goes back
  to `accepted`, and the stages decide again.
- A `bad` trace is never batched (`not_labelled_bad`, app/stages/distribution.py). A
  trace already batched stays in its batch: the review is kept, and its answer says
  the stage.

The queue's claims are leases in `review_claims`: the next trace served to a holder is
one nobody has reviewed and no other holder has a live claim on. A claim is taken by
one INSERT ... ON CONFLICT DO UPDATE WHERE <expired or ours>, which only one of two
racing reviewers can win; the loser picks again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.db.dialect import dialect_of, insert
from app.db.models import REVIEW_CLAIMS, REVIEWS, TRACES
from app.db.trace_queries import TraceFilter, labelled
from app.db.types import utcnow
from app.domain import MAX_REWARD, Label, Stage
from app.errors import Invalid, NotFound
from app.evaluation.scoring import breakdown_total

# How long a trace served by the queue stays with its reviewer: reading a long trace
# takes minutes; a reviewer who walks away frees it after this.
CLAIM_SECONDS = 15 * 60
# Claims lost to another reviewer in a row before giving up (each loss means that
# reviewer took a trace, so the queue moved on).
_CLAIM_TRIES = 8


@dataclass(frozen=True, slots=True)
class Claim:
    trace_id: str
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class ReviewInput:
    label: Label
    note: str | None = None
    reward: float | None = None  # overrides the computed reward; None: the computed one

    def __post_init__(self) -> None:
        # Bounded as every reward the hub takes (app/domain.py), from the API or a form.
        if self.reward is not None and not (
            math.isfinite(self.reward) and abs(self.reward) <= MAX_REWARD
        ):
            raise Invalid(f"reward must be a number from {-MAX_REWARD:g} to {MAX_REWARD:g}",
                          field="reward")


async def save_review(
    engine: AsyncEngine, trace_id: str, review: ReviewInput, reviewer: str
) -> dict[str, Any]:
    """Store the review (replacing an earlier one), set the reward it implies, and end
    any queue claim on the trace. Returns the review with the trace's stage and reward."""
    now = utcnow()
    async with engine.begin() as conn:
        # The write comes first: it takes SQLite's writer lock, and on PostgreSQL the
        # row's lock, so that a distributor forming a batch either sees the review or
        # has already batched the trace (then the answer says so).
        touched = await conn.execute(
            sa.update(TRACES).where(TRACES.c.trace_id == trace_id).values(updated_at=now)
        )
        if touched.rowcount != 1:
            raise NotFound(f"no trace with trace_id {trace_id!r}", field="trace_id")
        row = (await conn.execute(
            sa.select(TRACES.c.stage, TRACES.c.reward_breakdown)
            .where(TRACES.c.trace_id == trace_id)
        )).one()
        reward = review.reward if review.reward is not None else breakdown_total(
            row.reward_breakdown)
        stage = row.stage
        if review.reward is not None and stage == Stage.BELOW_THRESHOLD.value:
            stage = Stage.ACCEPTED.value  # the threshold is checked again on the new reward
        await conn.execute(
            sa.update(TRACES).where(TRACES.c.trace_id == trace_id)
            .values(reward=reward, stage=stage)
        )
        await conn.execute(sa.delete(REVIEWS).where(REVIEWS.c.trace_id == trace_id))
        record = {
            "trace_id": trace_id,
            "label": review.label.value,
            "note": review.note,
            "reward": review.reward,
            "reviewer": reviewer,
            "reviewed_at": now,
        }
        await conn.execute(sa.insert(REVIEWS).values(record))
        await conn.execute(sa.delete(REVIEW_CLAIMS).where(REVIEW_CLAIMS.c.trace_id == trace_id))
    return {**record, "reviewed_at": now.isoformat(), "stage": stage, "trace_reward": reward}


def not_labelled_bad() -> sa.ColumnElement[bool]:
    """Traces no reviewer has labelled bad: the only ones a batch may take."""
    return ~labelled("bad")


async def claim_next(
    engine: AsyncEngine,
    where: TraceFilter,
    holder: str,
    *,
    skip: str | None = None,
    seconds: float = CLAIM_SECONDS,
) -> Claim | None:
    """Claim the oldest unreviewed trace matching `where` that no other holder has a
    live claim on, for `seconds`; None when there is none. The holder's earlier claims
    are released (one trace at a time each); `skip` leaves that trace out this time."""
    for _ in range(_CLAIM_TRIES):
        async with engine.begin() as conn:
            now = utcnow()
            await conn.execute(sa.delete(REVIEW_CLAIMS).where(
                sa.or_(REVIEW_CLAIMS.c.holder == holder, REVIEW_CLAIMS.c.expires_at < now)))
            trace_id = await _pick(conn, where, skip)
            if trace_id is None:
                return None
            expires_at = now + timedelta(seconds=seconds)
            if await _claim(conn, trace_id, holder, now, expires_at):
                return Claim(trace_id, expires_at)
    return None


async def _pick(conn: AsyncConnection, where: TraceFilter, skip: str | None) -> str | None:
    claimed = sa.select(REVIEW_CLAIMS.c.trace_id).where(
        REVIEW_CLAIMS.c.trace_id == TRACES.c.trace_id)
    query = (
        sa.select(TRACES.c.trace_id)
        .where(*where.clauses(dialect_of(conn)), labelled("unreviewed"), ~claimed.exists())
        .order_by(TRACES.c.created_at, TRACES.c.trace_id)
        .limit(1)
    )
    if skip is not None:
        query = query.where(TRACES.c.trace_id != skip)
    return await conn.scalar(query)


async def _claim(
    conn: AsyncConnection, trace_id: str, holder: str, now: datetime, expires_at: datetime
) -> bool:
    values = {"trace_id": trace_id, "holder": holder, "expires_at": expires_at}
    c = REVIEW_CLAIMS.c
    stmt = insert(dialect_of(conn), REVIEW_CLAIMS).values(values).on_conflict_do_update(
        index_elements=[c.trace_id],
        set_={"holder": holder, "expires_at": expires_at},
        where=sa.or_(c.expires_at < now, c.holder == holder),
    ).returning(c.trace_id)
    return (await conn.execute(stmt)).first() is not None


async def waiting(conn: AsyncConnection, where: TraceFilter) -> int:
    """How many traces the queue has left to serve for `where`: unreviewed, and held
    by nobody (a trace being reviewed now is not counted)."""
    held = sa.select(REVIEW_CLAIMS.c.trace_id).where(
        REVIEW_CLAIMS.c.trace_id == TRACES.c.trace_id, REVIEW_CLAIMS.c.expires_at >= utcnow())
    query = sa.select(sa.func.count()).select_from(TRACES).where(
        *where.clauses(dialect_of(conn)), labelled("unreviewed"), ~held.exists())
    return int(await conn.scalar(query) or 0)


async def release(engine: AsyncEngine, trace_id: str, holder: str) -> bool:
    """End `holder`'s claim on the trace, if it has one (its page was left): the queue
    serves it to the next reviewer at once. Whether there was one to end."""
    async with engine.begin() as conn:
        ended = await conn.execute(sa.delete(REVIEW_CLAIMS).where(
            REVIEW_CLAIMS.c.trace_id == trace_id, REVIEW_CLAIMS.c.holder == holder))
    return bool(ended.rowcount)


async def claim_of(conn: AsyncConnection, trace_id: str) -> dict[str, Any] | None:
    """The live claim on a trace, if any: who holds it and until when."""
    row = (await conn.execute(
        sa.select(REVIEW_CLAIMS.c.holder, REVIEW_CLAIMS.c.expires_at)
        .where(REVIEW_CLAIMS.c.trace_id == trace_id, REVIEW_CLAIMS.c.expires_at >= utcnow())
    )).first()
    return None if row is None else {"holder": row.holder,
                                     "expires_at": row.expires_at.isoformat()}
