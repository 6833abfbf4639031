"""Reading traces back: one record, a filtered page with a cursor, and the stats."""

from __future__ import annotations

import base64
import binascii
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import orjson
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from app.db.dialect import Dialect, dialect_of, reject_reason_counts, rule_firing_counts
from app.db.models import BATCHES, TRACES
from app.domain import BatchState, Stage
from app.errors import BadRequest, NotFound

HISTOGRAM_BUCKET = 5.0
View = Literal["canonical", "original", "compressed"]

SUMMARY_COLUMNS = (
    TRACES.c.trace_id,
    TRACES.c.created_at,
    TRACES.c.stage,
    TRACES.c.status,
    TRACES.c.total_tokens,
    TRACES.c.compressed_tokens,
    TRACES.c.reward,
    TRACES.c.env_reward,
    TRACES.c.reject_reasons,
    TRACES.c.source_format,
    TRACES.c.env,
    TRACES.c.model,
    TRACES.c.agent_name,
    TRACES.c.policy_version,
)


@dataclass(frozen=True, slots=True)
class TraceFilter:
    stage: str | None = None
    status: str | None = None
    env: str | None = None
    model: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    since: datetime | None = None
    until: datetime | None = None
    # The environment's own reward; a bound leaves out traces that carry none.
    min_env_reward: float | None = None
    max_env_reward: float | None = None

    def clauses(self) -> list[sa.ColumnElement[bool]]:
        c = TRACES.c
        equal = {"stage": c.stage, "status": c.status, "env": c.env, "model": c.model}
        clauses = [col == getattr(self, name) for name, col in equal.items()
                   if getattr(self, name) is not None]
        if self.min_reward is not None:
            clauses.append(c.reward >= self.min_reward)
        if self.max_reward is not None:
            clauses.append(c.reward <= self.max_reward)
        if self.min_env_reward is not None:
            clauses.append(c.env_reward >= self.min_env_reward)
        if self.max_env_reward is not None:
            clauses.append(c.env_reward <= self.max_env_reward)
        if self.since is not None:
            clauses.append(c.created_at >= self.since)
        if self.until is not None:
            clauses.append(c.created_at < self.until)
        return clauses


async def get_trace(conn: AsyncConnection, trace_id: str, view: View) -> dict[str, Any]:
    payload = {"canonical": TRACES.c.trace, "original": TRACES.c.original}.get(
        view, TRACES.c.compressed
    )
    row = (
        await conn.execute(
            sa.select(
                *SUMMARY_COLUMNS,
                TRACES.c.updated_at,
                TRACES.c.reward_breakdown,
                TRACES.c.compression,
                TRACES.c.stage_error,
                payload.label("payload"),
            ).where(TRACES.c.trace_id == trace_id)
        )
    ).one_or_none()
    if row is None:
        raise NotFound(f"no trace with trace_id {trace_id!r}", field="trace_id")
    if view == "compressed" and row.payload is None:
        raise NotFound(
            f"trace {trace_id!r} has no compressed view (stage: {row.stage})", field="view"
        )
    record = _summary(row._mapping)
    record.update(
        updated_at=row.updated_at.isoformat(),
        reward_breakdown=row.reward_breakdown,
        compression=row.compression,
        stage_error=row.stage_error,
        view=view,
        trace=row.payload,
    )
    return record


async def list_traces(
    conn: AsyncConnection, where: TraceFilter, limit: int, cursor: str | None
) -> tuple[list[dict[str, Any]], str | None]:
    """Newest first, paged by `newest_first`."""
    query = sa.select(*SUMMARY_COLUMNS).where(*where.clauses())
    rows, next_cursor = await newest_first(conn, query, TRACES, limit, cursor)
    return [_summary(row._mapping) for row in rows], next_cursor


async def newest_first(
    conn: AsyncConnection, query: sa.Select[Any], table: sa.Table, limit: int, cursor: str | None
) -> tuple[list[sa.Row[Any]], str | None]:
    """One page of `query` over `table`, newest first, and the cursor of the next page.
    The cursor is opaque to clients: (created_at, primary key) of the last row, so
    paging is stable while new rows arrive."""
    key = next(iter(table.primary_key.columns))
    created_at = table.c.created_at
    if cursor:
        after = decode_cursor(cursor)
        query = query.where(sa.tuple_(created_at, key) < after)
    query = query.add_columns(created_at.label("_created_at"), key.label("_key"))
    query = query.order_by(created_at.desc(), key.desc()).limit(limit + 1)
    rows = (await conn.execute(query)).all()
    if len(rows) <= limit:
        return list(rows), None
    last = rows[limit - 1]
    return list(rows[:limit]), encode_cursor(last._created_at, last._key)


async def stats(conn: AsyncConnection) -> dict[str, Any]:
    c = TRACES.c
    totals = (
        await conn.execute(
            sa.select(
                sa.func.count(),
                sa.func.coalesce(sa.func.sum(c.total_tokens), 0),
                sa.func.coalesce(sa.func.sum(c.compressed_tokens), 0),
                sa.func.avg(c.reward),
                sa.func.count(c.env_reward),
                sa.func.avg(c.env_reward),
            )
        )
    ).one()
    by_stage = await _count_by(conn, c.stage)
    by_status = await _count_by(conn, c.status)
    return {
        "traces": totals[0],
        "by_stage": by_stage,
        "by_status": by_status,
        "total_tokens": int(totals[1]),
        "compressed_tokens": int(totals[2]),
        "mean_reward": float(totals[3]) if totals[3] is not None else None,
        # Traces that carry the environment's own reward, and its mean over them.
        "env_reward": {
            "traces": totals[4],
            "mean": float(totals[5]) if totals[5] is not None else None,
        },
        "batches": await batch_counts(conn),
        "compression": await _compression_stats(conn, by_stage),
        "rejections_by_filter": await _name_counts(conn, reject_reason_counts),
        "rule_firings": await _name_counts(conn, rule_firing_counts),
        "reward_histogram": await _reward_histogram(conn),
    }


async def _name_counts(
    conn: AsyncConnection, query: Callable[[Dialect], sa.TextClause]
) -> dict[str, int]:
    rows = await conn.execute(query(dialect_of(conn)))
    return {name: n for name, n in rows}


async def _reward_histogram(conn: AsyncConnection) -> list[dict[str, Any]]:
    """Traces per reward bucket, HISTOGRAM_BUCKET points wide. Rewards are sums of a
    few rule weights, so there are few distinct values: bucket them here, portably."""
    rows = await conn.execute(
        sa.select(TRACES.c.reward, sa.func.count())
        .where(TRACES.c.reward.is_not(None))
        .group_by(TRACES.c.reward)
    )
    buckets: Counter[float] = Counter()
    for reward, n in rows:
        buckets[math.floor(reward / HISTOGRAM_BUCKET) * HISTOGRAM_BUCKET] += n
    return [
        {"from": low, "to": low + HISTOGRAM_BUCKET, "traces": buckets[low]}
        for low in sorted(buckets)
    ]


async def _compression_stats(conn: AsyncConnection, by_stage: dict[str, int]) -> dict[str, Any]:
    """Counted from the columns compression writes, so traces that moved on to later
    stages still count: compressed_tokens is set only by a compression, `compression`
    (the record) by a compression or a skip."""
    c = TRACES.c
    compressed = c.compressed_tokens.is_not(None)
    row = (
        await conn.execute(
            sa.select(
                sa.func.count().filter(compressed),
                sa.func.count().filter(c.compression.is_not(None), ~compressed),
                sa.func.avg(sa.cast(c.compressed_tokens, sa.Float) / c.total_tokens).filter(
                    compressed, c.total_tokens > 0
                ),
                sa.func.count().filter(c.compression["fallback"].as_string().is_not(None)),
            )
        )
    ).one()
    return {
        "compressed": row[0],
        "skipped": row[1],
        "failed": by_stage.get(Stage.COMPRESSION_FAILED.value, 0),
        "fallbacks": row[3],
        "mean_ratio": round(float(row[2]), 4) if row[2] is not None else None,
    }


async def batch_counts(conn: AsyncConnection) -> dict[str, int]:
    """Batches by state (every state, 0 when none) and the total."""
    counted = await _count_by(conn, BATCHES.c.state)
    by_state = {state.value: counted.get(state.value, 0) for state in BatchState}
    return {**by_state, "total": sum(counted.values())}


async def pipeline_counts(conn: AsyncConnection) -> dict[str, Any]:
    """For /metrics: the count and the oldest created_at of traces by stage and of
    batches by state, and the tokens stored. Three aggregate queries."""
    return {
        "traces": await _count_and_oldest(conn, TRACES.c.stage, TRACES.c.created_at),
        "trace_tokens": int(
            await conn.scalar(sa.select(sa.func.coalesce(sa.func.sum(TRACES.c.total_tokens), 0)))
            or 0
        ),
        "batches": await _count_and_oldest(conn, BATCHES.c.state, BATCHES.c.created_at),
    }


async def _count_and_oldest(
    conn: AsyncConnection, key: sa.Column[Any], created_at: sa.Column[Any]
) -> dict[str, tuple[int, datetime | None]]:
    rows = await conn.execute(
        sa.select(key, sa.func.count(), sa.func.min(created_at)).group_by(key)
    )
    return {value: (n, oldest) for value, n, oldest in rows}


async def _count_by(conn: AsyncConnection, column: sa.Column[Any]) -> dict[str, int]:
    rows = await conn.execute(sa.select(column, sa.func.count()).group_by(column))
    return {key: count for key, count in rows}


def _summary(row: Any) -> dict[str, Any]:
    return {
        "trace_id": row["trace_id"],
        "created_at": row["created_at"].isoformat(),
        "stage": row["stage"],
        "status": row["status"],
        "total_tokens": row["total_tokens"],
        "compressed_tokens": row["compressed_tokens"],
        "reward": row["reward"],
        "env_reward": row["env_reward"],
        "reject_reasons": row["reject_reasons"] or [],
        "format": row["source_format"],
        "env": row["env"],
        "model": row["model"],
        "agent": row["agent_name"],
        "policy_version": row["policy_version"],
    }


def encode_cursor(created_at: datetime, trace_id: str) -> str:
    raw = orjson.dumps([created_at.isoformat(), trace_id])
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, trace_id = orjson.loads(raw)
        return datetime.fromisoformat(created_at), str(trace_id)
    except (binascii.Error, ValueError, TypeError, orjson.JSONDecodeError):
        raise BadRequest("cursor is not one this server gave out", field="cursor") from None
