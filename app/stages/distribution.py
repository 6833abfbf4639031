"""The distribution stage: passing traces become batches of exactly
distributor.batch_size, oldest first; traces under min_reward_threshold (inclusive:
reward >= threshold passes) become `below_threshold` and are never batched, and
neither is a trace a reviewer labelled `bad` (app/db/review_queries.py).

A batch is formed in one transaction: pick the oldest eligible traces (passing over
rows another worker has locked, on PostgreSQL), insert the batch and its members, move
the traces to `batched`. The members' primary key on trace_id refuses a trace that is
already in a batch, and the move checks each trace's stage, so distributors that race
can only lose (roll back and try again), never put a trace in two batches.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.config import DistributorConfig
from app.db.dialect import dialect_of, skip_locked, writing
from app.db.models import BATCHES, MEMBERS, TRACES
from app.db.moves import BATCH_STATES, TRACE_STAGES
from app.db.review_queries import not_labelled_bad
from app.db.types import utcnow
from app.domain import ELIGIBLE, BatchState, Stage

log = logging.getLogger("atropos.distribution")
@dataclass(frozen=True)
class FormedBatch:
    batch_id: str
    created_at: datetime
    trace_ids: list[str]


class _Raced(Exception):
    """Another distributor moved one of the picked traces first."""


class DistributionStage:
    name = "distribution"

    def __init__(
        self,
        engine: AsyncEngine,
        config: DistributorConfig,
        *,
        max_batches: int = 16,
        on_advance: Callable[[], None] | None = None,
    ) -> None:
        self._engine = engine
        self._config = config
        self._max_batches = max_batches  # per run_once, so the other stages get a turn
        self._on_advance = on_advance

    async def run_once(self) -> int:
        """Up to max_batches batches, formed in one transaction (one write turn and one
        commit for all of them); a race lost to another distributor is tried again."""
        for _ in range(_RACES_TRIED):
            try:
                async with writing(self._engine) as conn:
                    # First a write: on SQLite it takes the writer lock before the reads
                    # below, so no other writer can slip in between the pick and the move.
                    below = await mark_below_threshold(conn, self._config.min_reward_threshold)
                    formed: list[FormedBatch] = []
                    while len(formed) < self._max_batches and (
                            batch := await form_batch(conn, self._config)) is not None:
                        formed.append(batch)
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


# How many times a pass forms its batches again after another distributor took some
# of the traces it picked.
_RACES_TRIED = 3


async def mark_below_threshold(conn: AsyncConnection, threshold: float) -> int:
    """Move eligible traces whose reward is under `threshold` (or unknown) out of the way."""
    c = TRACES.c
    result = await conn.execute(
        TRACE_STAGES.move(Stage.BELOW_THRESHOLD, expected=ELIGIBLE)
        .where(sa.or_(c.reward.is_(None), c.reward < threshold))
    )
    return result.rowcount


async def form_batch(conn: AsyncConnection, config: DistributorConfig) -> FormedBatch | None:
    """One batch of exactly `batch_size` of the oldest eligible traces, or None when
    fewer are eligible. Runs inside the caller's transaction."""
    c = TRACES.c
    pick = (
        sa.select(c.trace_id)
        .where(c.stage.in_([s.value for s in ELIGIBLE]), c.reward >= config.min_reward_threshold,
               not_labelled_bad())
        .order_by(c.created_at, c.trace_id)
        .limit(config.batch_size)
    )
    trace_ids = list((await conn.execute(skip_locked(pick, dialect_of(conn)))).scalars())
    if len(trace_ids) < config.batch_size:
        return None
    now = utcnow()
    batch_id = f"b-{now:%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:12]}"
    await conn.execute(
        sa.insert(BATCHES).values(
            batch_id=batch_id, created_at=now, updated_at=now, size=len(trace_ids),
            target=config.target, format=config.format,
            state=BATCH_STATES.enter(BatchState.PENDING),
            attempts=0,
        )
    )
    await conn.execute(
        sa.insert(MEMBERS),
        [{"trace_id": t, "batch_id": batch_id, "position": i} for i, t in enumerate(trace_ids)],
    )
    moved = await conn.execute(
        TRACE_STAGES.move(Stage.BATCHED, expected=ELIGIBLE)
        .where(c.trace_id.in_(trace_ids))
        .values(updated_at=now)
    )
    if moved.rowcount != len(trace_ids):
        raise _Raced(batch_id)
    return FormedBatch(batch_id, now, trace_ids)
