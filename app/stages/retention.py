"""Retention: `atropos prune` and the worker's periodic clean-up (config.json
`retention`), the seed's weekly
`DELETE FROM traces WHERE created_at < datetime('now', '-30 days') AND reward < 5`
as a command.

It counts first, then deletes in batches of `batch_size`, each its own short
transaction (so ingest keeps going), and never deletes a trace that is still on its
way to training: not one in stage `batched`, not one in a batch that is not yet
delivered (when the batches tables exist), not one leased by a worker right now.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.config import RetentionConfig
from app.db import schedule
from app.db.dialect import after_bulk_delete, dialect_of, skip_locked, writing
from app.db.models import TRACES
from app.db.types import utcnow
from app.domain import NEVER_PRUNED, BatchState, Stage
from app.durations import format_duration
from app.stages.leases import lease_is_free

log = logging.getLogger("atropos.retention")

# The batches tables, named without their models: retention must work on a database
# that has them and on one that does not (yet).
_MEMBERS = sa.table("batch_traces", sa.column("trace_id"), sa.column("batch_id"))
_BATCHES = sa.table("batches", sa.column("batch_id"), sa.column("state"))


@dataclass(frozen=True, slots=True)
class Criteria:
    older_than: timedelta
    max_reward: float | None = None  # only rewards below it (the seed's `reward < 5`)
    stages: tuple[Stage, ...] = ()  # only these stages; empty: any

    @classmethod
    def from_config(cls, config: RetentionConfig) -> Criteria:
        return cls(config.older_than, config.max_reward, tuple(config.stages))

    def describe(self) -> str:
        parts = [f"older than {format_duration(self.older_than)}"]
        if self.max_reward is not None:
            parts.append(f"reward < {self.max_reward:g}")
        if self.stages:
            parts.append(f"stage {' or '.join(self.stages)}")
        return ", ".join(parts)


@dataclass(slots=True)
class Pruned:
    matched: int = 0
    deleted: int = 0
    batches: int = 0
    maintenance: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def prune(
    engine: AsyncEngine,
    criteria: Criteria,
    *,
    batch_size: int = 1000,
    dry_run: bool = False,
    vacuum: bool = True,
    on_deleted: Callable[[int, int], None] | None = None,
) -> Pruned:
    """Count the traces `criteria` selects, then (unless `dry_run`) delete them;
    `on_deleted(n, matched)` after each transaction that deleted n (the command's
    progress bar)."""
    cutoff = utcnow() - criteria.older_than
    async with engine.connect() as conn:
        where = await _where(conn, criteria, cutoff)
        count = sa.select(sa.func.count()).select_from(TRACES).where(*where)
        result = Pruned(matched=await conn.scalar(count) or 0)
    if dry_run or result.matched == 0:
        return result
    while True:
        async with writing(engine) as conn:
            where = await _where(conn, criteria, cutoff)
            pick = sa.select(TRACES.c.trace_id).where(*where).limit(batch_size)
            pick = skip_locked(pick, dialect_of(conn))
            deleted = (
                await conn.execute(
                    sa.delete(TRACES).where(TRACES.c.trace_id.in_(pick.scalar_subquery()))
                )
            ).rowcount
        if deleted:
            result.deleted += deleted
            result.batches += 1
            if on_deleted is not None:
                on_deleted(deleted, result.matched)
        if deleted < batch_size:
            break
    if result.deleted:
        result.maintenance = await _after_delete(engine, vacuum=vacuum)
    return result


class RetentionStage:
    """The `retention` section applied by the worker, once per `every` across all hub
    processes on the database (app/db/schedule.py). It does not VACUUM: that would hold
    SQLite's write lock while ingest is running; freed pages are reused anyway."""

    name = "retention"

    def __init__(self, engine: AsyncEngine, config: RetentionConfig) -> None:
        self._engine = engine
        self._config = config
        self._criteria = Criteria.from_config(config)

    async def run_once(self) -> int:
        if not await schedule.claim_if_due(self._engine, self.name, self._config.every):
            return 0
        result = await prune(
            self._engine, self._criteria, batch_size=self._config.batch_size, vacuum=False
        )
        await schedule.record_result(self._engine, self.name, result.to_json())
        log.info(
            "retention: deleted %d of %d traces matching %s",
            result.deleted,
            result.matched,
            self._criteria.describe(),
        )
        return result.deleted


async def _where(
    conn: AsyncConnection, criteria: Criteria, cutoff: datetime
) -> list[sa.ColumnElement[bool]]:
    c = TRACES.c
    kept = [s.value for s in NEVER_PRUNED]
    where = [c.created_at < cutoff, c.stage.not_in(kept), lease_is_free(TRACES)]
    if criteria.max_reward is not None:
        where.append(c.reward < criteria.max_reward)
    if criteria.stages:
        where.append(c.stage.in_([s.value for s in criteria.stages]))
    if await conn.run_sync(lambda sync: sa.inspect(sync).has_table("batch_traces")):
        where.append(
            ~sa.exists().where(
                _MEMBERS.c.trace_id == c.trace_id,
                _MEMBERS.c.batch_id == _BATCHES.c.batch_id,
                _BATCHES.c.state != BatchState.DELIVERED.value,
            )
        )
    return where


async def _after_delete(engine: AsyncEngine, *, vacuum: bool) -> list[str]:
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        statements = after_bulk_delete(dialect_of(conn), vacuum=vacuum)
        for statement in statements:
            await conn.execute(sa.text(statement))
    return statements
