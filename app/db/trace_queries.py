"""Reading traces back: one record, a filtered and sorted page with a cursor, and the
stats.

Pages are keyset-paged: the cursor holds the sort key and the trace_id of the last row,
so a page costs the same however deep it is and stays stable while traces arrive.
"""

from __future__ import annotations

import base64
import binascii
import math
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Literal

import orjson
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from app.db import search
from app.db.dialect import (
    Dialect,
    dialect_of,
    redaction_counts,
    reject_reason_counts,
    rejected_by_filter,
    rule_firing_counts,
    time_bucket,
)
from app.db.models import (
    BATCHES,
    MEMBERS,
    PAYLOADS,
    REVIEWS,
    TRACE_SEARCH,
    TRACES,
    WITH_PAYLOADS,
)
from app.domain import BatchState, Label, Stage
from app.errors import BadRequest, NotFound

HISTOGRAM_BUCKET = 5.0
View = Literal["canonical", "original", "compressed", "tokens"]
# A trace's review label, or `unreviewed` for the traces nobody has reviewed yet.
LabelFilter = Literal["good", "bad", "unreviewed"]
# The orders a page can come in: a column, descending with a leading "-". Each ties on
# trace_id, and each has an index that gives the order as it is (migration 0010).
Sort = Literal["-created_at", "created_at", "-reward", "reward", "-total_tokens", "total_tokens"]
SORTS: tuple[Sort, ...] = ("-created_at", "created_at", "-reward", "reward",
                           "-total_tokens", "total_tokens")

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
# What a listing shows beside the columns: the review label, and the task and final
# answer from the narrow search row (app/db/search.py), not from the payloads.
LISTED_COLUMNS = (
    *SUMMARY_COLUMNS,
    REVIEWS.c.label.label("review_label"),
    TRACE_SEARCH.c.task.label("search_task"),
    TRACE_SEARCH.c.final_answer.label("search_final_answer"),
)
LISTED = TRACES.outerjoin(REVIEWS).outerjoin(TRACE_SEARCH)


@dataclass(frozen=True, slots=True)
class TraceFilter:
    """The filters of GET /v1/traces and of the dashboard's list, which take the same
    query parameters."""

    stage: str | None = None
    status: str | None = None
    env: str | None = None
    model: str | None = None
    policy_version: str | None = None
    # The group of rollouts (metadata.group; an Atropos group an env sent).
    group: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    since: datetime | None = None
    until: datetime | None = None
    # The environment's own reward; a bound leaves out traces that carry none.
    min_env_reward: float | None = None
    max_env_reward: float | None = None
    label: LabelFilter | None = None
    # The name of a filter among the trace's reject reasons.
    rejected_by: str | None = None
    # Words in the task or the final answer (case-insensitive; ASCII only on SQLite).
    q: str | None = None

    def clauses(self, dialect: Dialect) -> list[sa.ColumnElement[bool]]:
        c = TRACES.c
        equal = {"stage": c.stage, "status": c.status, "env": c.env, "model": c.model,
                 "policy_version": c.policy_version, "group": c.group_id}
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
        if self.label is not None:
            clauses.append(labelled(self.label))
        if self.rejected_by is not None:
            clauses.append(rejected_by_filter(dialect, self.rejected_by))
        if self.words is not None:
            clauses.append(c.trace_id.in_(search.matching(self.words)))
        return clauses

    @property
    def words(self) -> str | None:
        """What `q` searches for, as the search text is kept (lowercased)."""
        words = (self.q or "").strip().lower()
        return words or None


def labelled(label: LabelFilter) -> sa.ColumnElement[bool]:
    """Traces with this review label (`unreviewed`: with no review)."""
    # An alias: the outer query may join reviews itself (to show the label).
    review = REVIEWS.alias("labelled")
    reviewed = sa.select(review.c.trace_id).where(review.c.trace_id == TRACES.c.trace_id)
    if label == "unreviewed":
        return ~reviewed.exists()
    return reviewed.where(review.c.label == Label(label).value).exists()


async def get_original(conn: AsyncConnection, trace_id: str) -> tuple[str, Any]:
    """The trace's source format and original, as it was stored."""
    row = (await conn.execute(
        sa.select(TRACES.c.source_format, PAYLOADS.c.original).select_from(WITH_PAYLOADS)
        .where(TRACES.c.trace_id == trace_id)
    )).one_or_none()
    if row is None:
        raise NotFound(f"no trace with trace_id {trace_id!r}", field="trace_id")
    return row.source_format, row.original


async def get_trace(conn: AsyncConnection, trace_id: str, view: View) -> dict[str, Any]:
    payload = {"canonical": PAYLOADS.c.trace, "original": PAYLOADS.c.original}.get(
        view, PAYLOADS.c.compressed
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
                *REVIEW_COLUMNS,
                TRACE_SEARCH.c.task.label("search_task"),
                TRACE_SEARCH.c.final_answer.label("search_final_answer"),
                MEMBERS.c.batch_id,
            )
            .select_from(LISTED.join(PAYLOADS, PAYLOADS.c.trace_id == TRACES.c.trace_id)
                         .outerjoin(MEMBERS))
            .where(TRACES.c.trace_id == trace_id)
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
        review=_review(row._mapping),
        batch_id=row.batch_id,
        view=view,
        trace=row.payload,
    )
    return record


async def list_traces(
    conn: AsyncConnection,
    where: TraceFilter,
    limit: int,
    cursor: str | None,
    sort: Sort = "-created_at",
) -> tuple[list[dict[str, Any]], str | None]:
    """One page in `sort` order, and the cursor of the next. With a search (`q`), each
    record says where it matched (`snippet`)."""
    order = _order(sort)
    query = sa.select(*LISTED_COLUMNS).select_from(LISTED)
    words = where.words
    if words is None:
        page = await keyset_page(
            conn, query.where(*where.clauses(dialect_of(conn))), order, limit, cursor)
    else:
        page = await _search_page(conn, query, where, order, limit, cursor)
    rows, next_cursor = page
    records = [_summary(row._mapping) for row in rows]
    if words is not None:
        for record, row in zip(records, rows, strict=True):
            record["snippet"] = search.snippet(words, row.search_task, row.search_final_answer)
    return records, next_cursor


async def count_traces(conn: AsyncConnection, where: TraceFilter) -> int:
    """How many traces match `where`, all pages together (a search's matches: a read
    of the narrow search table, as a search that finds few does)."""
    query = sa.select(sa.func.count()).select_from(TRACES).where(
        *where.clauses(dialect_of(conn)))
    return int(await conn.scalar(query) or 0)


# A search first reads this many traces in page order and checks each one's text: a
# word that common (one trace in 40 for a page of 50) fills the page from them, where
# a search index would list every match first, tens of thousands. Only a rarer word
# goes to the index.
SEARCH_PROBE = 2000


async def _search_page(
    conn: AsyncConnection,
    query: sa.Select[Any],
    where: TraceFilter,
    order: Order,
    limit: int,
    cursor: str | None,
) -> tuple[list[sa.Row[Any]], str | None]:
    words = where.words
    assert words is not None
    others = replace(where, q=None).clauses(dialect_of(conn))
    window = sa.select(TRACES.c.trace_id).where(*others, order.column.is_not(None))
    if cursor:
        window = window.where(_after(order, decode_cursor(cursor, order.name)))
    window = window.order_by(*_order_by(order)).limit(SEARCH_PROBE)
    # The listing joins each trace's search row: its text is checked where it stands.
    probed = query.where(*others, TRACES.c.trace_id.in_(window), search.has_words(words))
    rows, next_cursor = await keyset_page(conn, probed, order, limit, cursor)
    if next_cursor is not None:
        return rows, next_cursor
    read = await conn.scalar(sa.select(sa.func.count()).select_from(window.subquery()))
    if (read or 0) < SEARCH_PROBE:
        return rows, None  # every trace after the cursor was read: that was the last page
    return await keyset_page(conn, query.where(*where.clauses(dialect_of(conn))), order,
                             limit, cursor)


@dataclass(frozen=True, slots=True)
class Order:
    """A page order: by `column`, ties broken by the table's primary key `key`."""

    name: str
    column: sa.ColumnElement[Any]
    key: sa.ColumnElement[Any]
    descending: bool


def _order(sort: Sort) -> Order:
    if sort not in SORTS:
        raise BadRequest(f"sort must be one of {', '.join(SORTS)}", field="sort")
    column = TRACES.c[sort.lstrip("-")]
    return Order(sort, column, TRACES.c.trace_id, sort.startswith("-"))


async def newest_first(
    conn: AsyncConnection, query: sa.Select[Any], table: sa.Table, limit: int, cursor: str | None
) -> tuple[list[sa.Row[Any]], str | None]:
    """One page of `query` over `table`, newest first (keyset_page by created_at)."""
    key = next(iter(table.primary_key.columns))
    order = Order("-created_at", table.c.created_at, key, descending=True)
    return await keyset_page(conn, query, order, limit, cursor)


async def keyset_page(
    conn: AsyncConnection, query: sa.Select[Any], order: Order, limit: int, cursor: str | None
) -> tuple[list[sa.Row[Any]], str | None]:
    """One page of `query` in `order`, and the cursor of the next page. The cursor is
    opaque to clients: the order's name, and the sort value and key of the last row.
    Rows whose sort value is NULL have no place in the order and are left out."""
    if cursor:
        query = query.where(_after(order, decode_cursor(cursor, order.name)))
    query = query.where(order.column.is_not(None))
    query = query.add_columns(order.column.label("_sort"), order.key.label("_key"))
    rows = (await conn.execute(query.order_by(*_order_by(order)).limit(limit + 1))).all()
    if len(rows) <= limit:
        return list(rows), None
    last = rows[limit - 1]
    return list(rows[:limit]), encode_cursor(order.name, last._sort, last._key)


def _after(order: Order, position: tuple[Any, str]) -> sa.ColumnElement[bool]:
    """The rows that come after `position` (sort value, key) in `order`."""
    here = sa.tuple_(order.column, order.key)
    return here < position if order.descending else here > position


def _order_by(order: Order) -> list[sa.UnaryExpression[Any]]:
    if order.descending:
        return [order.column.desc(), order.key.desc()]
    return [order.column.asc(), order.key.asc()]


async def stats(
    conn: AsyncConnection, threshold: float, *, rule_firings: bool = True
) -> dict[str, Any]:
    """The figures of GET /v1/stats; `threshold`: distributor.min_reward_threshold.
    `rule_firings` (a read of every breakdown, the dearest part) may be left out by a
    caller that does not show them."""
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
                sa.func.count().filter(c.env_reward.is_not(None), c.reward >= threshold),
                sa.func.min(c.env_reward).filter(_finite(c.env_reward)),
                sa.func.max(c.env_reward).filter(_finite(c.env_reward)),
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
        # Traces that carry the environment's own reward: its mean and spread over
        # them, and how many of them pass the threshold (their reward, which the env's
        # enters weighted): what an imported corpus, mostly of status unknown, holds.
        "env_reward": {
            "traces": totals[4],
            "mean": float(totals[5]) if totals[5] is not None else None,
            "passing": totals[6],
            "passing_share": totals[6] / totals[4] if totals[4] else None,
            "threshold": threshold,
            "histogram": await _env_reward_histogram(conn, totals[7], totals[8]),
        },
        "batches": await batch_counts(conn),
        "compression": await _compression_stats(conn, by_stage),
        "rejections_by_filter": await _name_counts(conn, reject_reason_counts),
        "rule_firings": await _name_counts(conn, rule_firing_counts) if rule_firings else {},
        "redactions": {
            name: int(n) for name, n in (await _name_counts(conn, redaction_counts)).items()
        },
        "reward_histogram": await _reward_histogram(conn),
    }


async def over_time(
    conn: AsyncConnection, where: TraceFilter, bucket_seconds: int
) -> list[dict[str, Any]]:
    """Per time bucket of `bucket_seconds` (by created_at): traces stored, their mean
    reward, the share rejected, and the mean compression ratio of those compressed."""
    c = TRACES.c
    bucket = time_bucket(dialect_of(conn), c.created_at, bucket_seconds).label("bucket")
    compressed = c.compressed_tokens.is_not(None)
    rows = await conn.execute(
        sa.select(
            bucket,
            sa.func.count(),
            sa.func.avg(c.reward),
            sa.func.count().filter(c.stage == Stage.REJECTED.value),
            sa.func.avg(sa.cast(c.compressed_tokens, sa.Float) / c.total_tokens).filter(
                compressed, c.total_tokens > 0),
        )
        .where(*where.clauses(dialect_of(conn)))
        .group_by(bucket)
        .order_by(bucket)
    )
    return [
        {"start": datetime.fromtimestamp(int(start), UTC), "traces": n,
         "mean_reward": mean, "rejected_share": rejected / n if n else None,
         "compression_ratio": ratio}
        for start, n, mean, rejected, ratio in rows
    ]


async def time_span(conn: AsyncConnection) -> tuple[datetime, datetime] | None:
    """The created_at of the oldest and newest trace (both ends of its index)."""
    row = (await conn.execute(
        sa.select(sa.func.min(TRACES.c.created_at), sa.func.max(TRACES.c.created_at))
    )).one()
    return None if row[0] is None else (row[0], row[1])


async def distinct_values(conn: AsyncConnection, column: str, limit: int = 200) -> list[str]:
    """The values of an indexed label column (env, model), for the filter forms: one
    index seek per value (a loose index scan), not a read of every row."""
    col = TRACES.c[column]
    first = sa.select(sa.func.min(col)).scalar_subquery()
    seen = sa.select(first.label("value")).cte("seen", recursive=True)
    following = sa.select(sa.func.min(col)).where(col > seen.c.value).scalar_subquery()
    seen = seen.union_all(sa.select(following).where(seen.c.value.is_not(None)))
    rows = await conn.execute(
        sa.select(seen.c.value).where(seen.c.value.is_not(None)).limit(limit))
    return list(rows.scalars())


async def summaries(conn: AsyncConnection, trace_ids: list[str]) -> list[dict[str, Any]]:
    """The listing records of these traces, in the order given (a batch's members)."""
    rows = await conn.execute(
        sa.select(*LISTED_COLUMNS).select_from(LISTED)
        .where(TRACES.c.trace_id.in_(trace_ids))
    )
    found = {row.trace_id: _summary(row._mapping) for row in rows}
    return [found[t] for t in trace_ids if t in found]


async def label_counts(conn: AsyncConnection) -> dict[str, int]:
    """Reviewed traces by label."""
    rows = await conn.execute(
        sa.select(REVIEWS.c.label, sa.func.count()).group_by(REVIEWS.c.label))
    return {label: n for label, n in rows}


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
        if not math.isfinite(reward):
            continue  # stored before rewards were bounded: in no bucket
        buckets[math.floor(reward / HISTOGRAM_BUCKET) * HISTOGRAM_BUCKET] += n
    return [
        {"from": low, "to": low + HISTOGRAM_BUCKET, "traces": buckets[low]}
        for low in sorted(buckets)
    ]


# The environment's rewards are any numbers an env sends (often 0..1, or a few
# values): their range is cut into this many buckets of equal width.
ENV_REWARD_BUCKETS = 10


def _finite(column: sa.ColumnElement[float]) -> sa.ColumnElement[bool]:
    """Rows stored before rewards were bounded may hold an infinity: in no bucket."""
    return column.between(-sys.float_info.max, sys.float_info.max)


async def _env_reward_histogram(
    conn: AsyncConnection, low: float | None, high: float | None
) -> list[dict[str, Any]]:
    """Traces per bucket of env_reward, ENV_REWARD_BUCKETS equal buckets from the lowest
    to the highest (the last includes the highest); one bucket when all are equal."""
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        return []
    width = (high - low) / ENV_REWARD_BUCKETS
    if width <= 0:
        return [{"from": low, "to": high, "traces": await conn.scalar(
            sa.select(sa.func.count()).where(TRACES.c.env_reward == low))}]
    env = TRACES.c.env_reward
    # CASE rather than floor(): the same SQL on both databases.
    bucket = sa.case(
        *((env < low + (i + 1) * width, i) for i in range(ENV_REWARD_BUCKETS - 1)),
        else_=ENV_REWARD_BUCKETS - 1,
    ).label("bucket")
    rows = await conn.execute(
        sa.select(bucket, sa.func.count()).where(_finite(env)).group_by(bucket))
    counts = {int(i): n for i, n in rows}
    return [{"from": low + i * width, "to": high if i == ENV_REWARD_BUCKETS - 1
             else low + (i + 1) * width, "traces": counts.get(i, 0)}
            for i in range(ENV_REWARD_BUCKETS)]


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
    batches by state, and the tokens stored. One statement, so one snapshot: a scrape
    never shows a batch delivered whose traces are not yet (PostgreSQL's read committed
    gives each statement its own)."""
    traces = sa.select(sa.literal("trace").label("kind"), TRACES.c.stage.label("key"),
                       sa.func.count().label("n"), sa.func.min(TRACES.c.created_at),
                       sa.func.coalesce(sa.func.sum(TRACES.c.total_tokens), 0)
                       ).group_by(TRACES.c.stage)
    batches = sa.select(sa.literal("batch"), BATCHES.c.state, sa.func.count(),
                        sa.func.min(BATCHES.c.created_at), sa.literal(0)
                        ).group_by(BATCHES.c.state)
    counts: dict[str, Any] = {"traces": {}, "trace_tokens": 0, "batches": {}}
    for kind, key, n, oldest, tokens in await conn.execute(sa.union_all(traces, batches)):
        if kind == "trace":
            counts["traces"][key] = (n, oldest)
            counts["trace_tokens"] += int(tokens)
        else:
            counts["batches"][key] = (n, oldest)
    return counts


async def _count_by(conn: AsyncConnection, column: sa.Column[Any]) -> dict[str, int]:
    rows = await conn.execute(sa.select(column, sa.func.count()).group_by(column))
    return {key: count for key, count in rows}


REVIEW_COLUMNS = (
    REVIEWS.c.label.label("review_label"),
    REVIEWS.c.note.label("review_note"),
    REVIEWS.c.reward.label("review_reward"),
    REVIEWS.c.reviewer.label("review_reviewer"),
    REVIEWS.c.reviewed_at.label("review_reviewed_at"),
)


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
        "label": row["review_label"],
        "task": search.preview(row["search_task"]),
        "final_answer": search.preview(row["search_final_answer"]),
    }


def _review(row: Any) -> dict[str, Any] | None:
    if row["review_label"] is None:
        return None
    return {
        "label": row["review_label"],
        "note": row["review_note"],
        "reward": row["review_reward"],
        "reviewer": row["review_reviewer"],
        "reviewed_at": row["review_reviewed_at"].isoformat(),
    }


def encode_cursor(order: str, value: Any, key: str) -> str:
    if isinstance(value, datetime):
        value = value.isoformat()
    raw = orjson.dumps([order, value, key])
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, order: str) -> tuple[Any, str]:
    """(sort value, key) of the row a page ends on; the cursor must come from a page in
    the same order."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        name, value, key = orjson.loads(raw)
        if name != order:
            raise BadRequest(
                f"cursor is from a page sorted by {name}, not {order}: keep the sort "
                "with its cursor", field="cursor")
        if order.endswith("created_at"):
            value = datetime.fromisoformat(value)
        elif not isinstance(value, int | float):
            raise ValueError(value)
        return value, str(key)
    except (binascii.Error, ValueError, TypeError, orjson.JSONDecodeError):
        raise BadRequest("cursor is not one this server gave out", field="cursor") from None
