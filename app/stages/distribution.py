"""The distribution stage: passing traces become batches of exactly
distributor.batch_size, oldest first; traces under min_reward_threshold (inclusive:
reward >= threshold passes) become `below_threshold` and are never batched, and
neither is a trace a reviewer labelled `bad` (app/db/review_queries.py).

A pass forms its batches in one transaction, with one statement each: pick the oldest
eligible traces for up to max_batches batches (passing over rows another worker has
locked, on PostgreSQL), insert the batches, their members, move the traces to
`batched`. The members' primary key on trace_id refuses a trace that is
already in a batch, and the move checks each trace's stage, so distributors that race
can only lose (roll back and try again), never put a trace in two batches.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import DistributorConfig
from app.db.dialect import OneHop, dialect_of, skip_locked
from app.db.models import BATCHES, MEMBERS, TRACES
from app.db.moves import BATCH_STATES, TRACE_STAGES
from app.db.review_queries import not_labelled_bad
from app.db.types import utcnow
from app.domain import ELIGIBLE, BatchState, Stage
from app.stages import DISTRIBUTION

log = logging.getLogger("atropos.distribution")
@dataclass(frozen=True)
class FormedBatch:
    batch_id: str
    created_at: datetime
    trace_ids: list[str]


class _Raced(Exception):
    """Another distributor moved one of the picked traces first."""


class DistributionStage:
    name = DISTRIBUTION

    def __init__(
        self,
        engine: AsyncEngine,
        config: DistributorConfig,
        *,
        max_batches: int = 16,
        on_advance: Callable[[], None] | None = None,
        writer: OneHop | None = None,
    ) -> None:
        """`writer`: the hub's one (without it, one of the stage's own)."""
        self._engine = engine
        self._writer = writer or OneHop(engine)
        self._config = config
        self._max_batches = max_batches  # per run_once, so the other stages get a turn
        self._on_advance = on_advance

    @property
    def batch(self) -> int:
        """(ComesDue) the traces a pass batches at most."""
        return self._max_batches * self._config.batch_size

    async def run_once(self) -> int:
        """Up to max_batches batches, formed in one transaction in the hub's writer (one
        write turn, one hop and one commit for all of them); a race lost to another
        distributor is tried again."""
        for _ in range(_RACES_TRIED):
            try:
                below, formed = await self._writer.run(self._pass)
            except (IntegrityError, _Raced):
                log.info("another distributor took some of these traces first; picking again")
                continue
            break
        else:
            return 0
        for batch in formed:
            log.info("batch %s formed: %d traces (%s .. %s)", batch.batch_id,
                     len(batch.trace_ids), batch.trace_ids[0], batch.trace_ids[-1],
                     extra={"batch_id": batch.batch_id})
        advanced = below + sum(len(batch.trace_ids) for batch in formed)
        if advanced and self._on_advance is not None:
            self._on_advance()
        return advanced

    def _pass(self, conn: sa.Connection) -> tuple[int, list[FormedBatch]]:
        # The writer begins IMMEDIATE on SQLite: no other writer slips in between the
        # pick and the move.
        below = mark_below_threshold(conn, self._config.min_reward_threshold)
        return below, form_batches(conn, self._config, self._max_batches)


# How many times a pass forms its batches again after another distributor took some
# of the traces it picked.
_RACES_TRIED = 3


def mark_below_threshold(conn: sa.Connection, threshold: float) -> int:
    """Move eligible traces whose reward is under `threshold` (or unknown) out of the way."""
    c = TRACES.c
    result = conn.execute(
        TRACE_STAGES.move(Stage.BELOW_THRESHOLD, expected=ELIGIBLE)
        .where(sa.or_(c.reward.is_(None), c.reward < threshold))
    )
    return result.rowcount


def form_batches(
    conn: sa.Connection, config: DistributorConfig, most: int = 1
) -> list[FormedBatch]:
    """Up to `most` batches of exactly `batch_size` of the oldest eligible traces (none
    when fewer are eligible), each statement once for all of them. Runs inside the
    caller's transaction; raises _Raced when another distributor moved a picked trace."""
    c = TRACES.c
    size = config.batch_size
    pick = (
        sa.select(c.trace_id)
        .where(c.stage.in_([s.value for s in ELIGIBLE]), c.reward >= config.min_reward_threshold,
               not_labelled_bad())
        .order_by(c.created_at, c.trace_id)
        .limit(size * most)
    )
    picked = list((conn.execute(skip_locked(pick, dialect_of(conn)))).scalars())
    full = len(picked) // size
    if not full:
        return []
    now = utcnow()
    # A microsecond apart, so that the batches (delivered and listed by created_at)
    # keep the order of their traces.
    formed = [FormedBatch(f"b-{now:%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:12]}",
                          now + timedelta(microseconds=n), picked[n * size:(n + 1) * size])
              for n in range(full)]
    pending = BATCH_STATES.enter(BatchState.PENDING)
    conn.execute(sa.insert(BATCHES), [
        {"batch_id": batch.batch_id, "created_at": batch.created_at, "updated_at": now,
         "size": size,
         "target": config.target, "format": config.format, "state": pending, "attempts": 0}
        for batch in formed])
    conn.execute(sa.insert(MEMBERS), [
        {"trace_id": t, "batch_id": batch.batch_id, "position": i}
        for batch in formed for i, t in enumerate(batch.trace_ids)])
    trace_ids = picked[:full * size]
    moved = conn.execute(
        TRACE_STAGES.move(Stage.BATCHED, expected=ELIGIBLE)
        .where(c.trace_id.in_(trace_ids))
        .values(updated_at=now)
    )
    if moved.rowcount != len(trace_ids):
        raise _Raced(formed[0].batch_id)
    return formed
