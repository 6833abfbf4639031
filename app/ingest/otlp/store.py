"""The statements on otlp_spans and otlp_traces (app/db/models.py says what each row
means): spans stored once each, traces coming due, and what the assembly made of them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from app.db.assembly import FINAL_STAGES, AssemblyTable, Due
from app.db.dialect import dialect_of, insert_ignoring_conflicts
from app.db.models import OTLP_SPANS, OTLP_TRACES, TRACES
from app.db.moves import StateMachine
from app.formats.otlp.wire import SpanRecord

_SPAN_COLUMNS = ("trace_id", "span_id", "start_ns", "resource", "scope", "span", "redactions")


class TraceState(StrEnum):
    """Where a trace's assembly is (the otlp_traces.state column).

    open -> assembled | refused; assembled -> sent once its trajectory is batched (or
    deleted); refused -> dropped otlp.max_wait_seconds after its last span. A new span
    makes any of them open again; one for a sent trace is counted late."""

    OPEN = "open"  # it has spans its trajectory does not hold yet
    ASSEMBLED = "assembled"  # its trajectory holds every span; they are kept to assemble again
    SENT = "sent"  # its trajectory was batched or deleted: its spans are deleted
    REFUSED = "refused"  # its spans make no trajectory; `error` says why
    DROPPED = "dropped"  # refused, and its spans deleted since


# The moves the stage makes (app/db/moves.py). Every state reopens when a new span
# arrives: the receiver's insert-or-update does that, the one write of this column that
# is not a move (an upsert has no WHERE on the state).
TRANSITIONS: dict[TraceState, frozenset[TraceState]] = {
    TraceState.OPEN: frozenset({TraceState.ASSEMBLED, TraceState.REFUSED, TraceState.SENT}),
    TraceState.ASSEMBLED: frozenset({TraceState.SENT, TraceState.OPEN}),
    TraceState.SENT: frozenset({TraceState.OPEN}),
    TraceState.REFUSED: frozenset({TraceState.DROPPED, TraceState.OPEN}),
    TraceState.DROPPED: frozenset({TraceState.OPEN}),
}
TRACE_STATES: StateMachine[TraceState] = StateMachine(
    "OTLP trace", OTLP_TRACES.c.state, TRANSITIONS, entries={TraceState.OPEN}
)
# The traces' assembly (app/db/assembly.py): a trace is assembled from its spans.
TRACE_ASSEMBLY: AssemblyTable[TraceState] = AssemblyTable(
    TRACE_STATES, id="trace_id", parts="spans", seen="seen_spans", late="late_spans",
    first="first_span_at", last="last_span_at", open=TraceState.OPEN,
    assembled=TraceState.ASSEMBLED, refused=TraceState.REFUSED, batched=TraceState.SENT,
)


def add_spans(conn: sa.Connection, records: Sequence[SpanRecord], now: datetime) -> int:
    """Store the spans not stored yet and open their traces; returns how many were new.
    (A synchronous connection: the receiver writes in one hop, app/db/dialect.OneHop.)"""
    if not records:
        return 0
    dialect = dialect_of(conn)
    once = insert_ignoring_conflicts(dialect, OTLP_SPANS, "trace_id", "span_id")
    new = conn.execute(
        once.returning(OTLP_SPANS.c.trace_id, OTLP_SPANS.c.span_id),
        [{name: getattr(r, name) for name in _SPAN_COLUMNS} for r in records],
    ).all()
    if not new:
        return 0  # all resent: nothing changes, no trace reopens
    per_trace = Counter(row.trace_id for row in new)
    fresh = {(row.trace_id, row.span_id) for row in new}
    roots = {r.trace_id for r in records if r.root and (r.trace_id, r.span_id) in fresh}
    t = OTLP_TRACES.c
    conn.execute(
        TRACE_ASSEMBLY.reopen(
            dialect, lambda excluded: {"root_ended": sa.or_(t.root_ended, excluded.root_ended)}
        ),
        [{**TRACE_ASSEMBLY.opened(trace_id, count, now), "root_ended": trace_id in roots}
         for trace_id, count in per_trace.items()],
    )
    return len(new)


async def due(
    conn: AsyncConnection, now: datetime, quiet: float, max_wait: float, limit: int,
    exclude: Sequence[str] = (),
) -> list[Due]:
    """Open traces whose root span has ended and that have been quiet for `quiet`
    seconds, or whose first span came `max_wait` seconds ago; oldest first; but those
    in `exclude` (in preparation already)."""
    t = OTLP_TRACES.c
    return await TRACE_ASSEMBLY.due(conn, sa.or_(
        sa.and_(t.root_ended, t.last_span_at <= now - timedelta(seconds=quiet)),
        t.first_span_at <= now - timedelta(seconds=max_wait),
    ), limit, exclude)


async def oldest_due(
    conn: AsyncConnection, now: datetime, quiet: float, max_wait: float
) -> datetime | None:
    """When the trace due longest, of those `due` returns, came due; None if none is."""
    t = OTLP_TRACES.c
    quiet_for, max_wait_for = timedelta(seconds=quiet), timedelta(seconds=max_wait)
    open_ = t.state == TraceState.OPEN.value
    last, first = (await conn.execute(sa.select(
        sa.select(sa.func.min(t.last_span_at))
        .where(open_, t.root_ended, t.last_span_at <= now - quiet_for).scalar_subquery(),
        sa.select(sa.func.min(t.first_span_at))
        .where(open_, t.first_span_at <= now - max_wait_for).scalar_subquery(),
    ))).one()
    candidates = [at + wait for at, wait in ((last, quiet_for), (first, max_wait_for)) if at]
    return min(candidates, default=None)


@dataclass(slots=True)
class TraceSpans:
    """A trace's stored spans, as (resource, scope, span) in start order, and the
    secrets redacted from them before they were stored; `left_out`: the spans past
    the trace's bounds, not read."""

    spans: list[tuple[bytes, bytes, bytes]] = field(default_factory=list)
    redactions: Counter[str] = field(default_factory=Counter)
    size: int = 0  # bytes of `spans`
    left_out: int = 0


async def spans_of(
    conn: AsyncConnection, trace_ids: list[str], *, max_spans: int, max_bytes: int,
    budget: int,
) -> dict[str, TraceSpans]:
    """The spans of `trace_ids`, each trace's first `max_spans` by start time, up to
    `max_bytes` of them (the rest counted as left out), read as a stream: traces in
    the order given, until `budget` bytes are held (one trace at least); the traces
    after that are not in the answer (the next pass reads them)."""
    if not trace_ids:
        return {}
    s = OTLP_SPANS.c
    order = sa.case({trace_id: i for i, trace_id in enumerate(trace_ids)}, value=s.trace_id)
    rows = await conn.stream(
        sa.select(s.trace_id, s.resource, s.scope, s.span, s.redactions)
        .where(s.trace_id.in_(trace_ids))
        .order_by(order, s.start_ns, s.span_id)
    )
    out: dict[str, TraceSpans] = {}
    held = 0
    read_all = True
    try:
        async for row in rows:
            found = out.get(row.trace_id)
            if found is None:
                if out and held >= budget:
                    read_all = False
                    break
                found = out[row.trace_id] = TraceSpans()
            size = len(row.resource) + len(row.scope) + len(row.span)
            if found.left_out or len(found.spans) >= max_spans or (
                found.spans and found.size + size > max_bytes
            ):
                found.left_out += 1
                continue
            found.spans.append((row.resource, row.scope, row.span))
            found.size += size
            held += size
            if row.redactions:
                found.redactions.update(row.redactions)
    finally:
        await rows.close()
    if read_all:  # every trace read: those without spans too
        for trace_id in trace_ids:
            out.setdefault(trace_id, TraceSpans())
    return out


async def run_continued(conn: AsyncConnection, prefixes: list[str]) -> str | None:
    """The run (the trace whose trajectory holds it) of the assembled bare call whose
    conversation a call with these prefix digests continues: the longest prefix's."""
    if not prefixes:
        return None
    t = OTLP_TRACES.c
    rows = await conn.execute(
        sa.select(t.continues, sa.func.coalesce(t.joined, t.trace_id).label("run"))
        .where(t.continues.in_(prefixes), t.state == TraceState.ASSEMBLED.value)
    )
    found = {row.continues: row.run for row in rows}
    return next((found[p] for p in prefixes if p in found), None)


async def joined_to(conn: AsyncConnection, runs: list[str]) -> dict[str, list[str]]:
    """The traces joined to each of `runs`, by their first span."""
    if not runs:
        return {}
    t = OTLP_TRACES.c
    rows = await conn.execute(sa.select(t.joined, t.trace_id).where(t.joined.in_(runs))
                              .order_by(t.first_span_at, t.trace_id))
    out: dict[str, list[str]] = {}
    for row in rows:
        out.setdefault(row.joined, []).append(row.trace_id)
    return out


async def note_calls(conn: AsyncConnection, calls: dict[str, tuple[str | None, str | None]]
                     ) -> None:
    """Each bare call's continuation digest and the run it joined (trace_id ->
    (continues, joined))."""
    if not calls:
        return
    t = OTLP_TRACES.c
    await conn.execute(
        sa.update(OTLP_TRACES).where(t.trace_id == sa.bindparam("b_trace_id", type_=sa.String))
        .values(continues=sa.bindparam("b_continues", type_=sa.String),
                joined=sa.bindparam("b_joined", type_=sa.String)),
        [{"b_trace_id": trace_id, "b_continues": continues, "b_joined": joined}
         for trace_id, (continues, joined) in calls.items()],
    )


async def forget(conn: AsyncConnection, now: datetime, max_wait: float, limit: int) -> int:
    """Delete the spans no trajectory needs any more: those of traces whose trajectory
    was batched or deleted (-> sent), and those of refused traces `max_wait` seconds
    after their last span (-> dropped). Returns how many traces. The state moves first:
    a span arriving meanwhile reopens its trace after this commits, and stays."""
    t, traces = OTLP_TRACES.c, TRACES.c
    # A joined bare call's spans are its run's trajectory's.
    final = (
        sa.select(t.trace_id)
        .outerjoin(TRACES, traces.trace_id == sa.func.coalesce(t.joined, t.trace_id))
        .where(t.state == TraceState.ASSEMBLED.value,
               sa.or_(traces.trace_id.is_(None), traces.stage.in_(FINAL_STAGES)))
        .limit(limit)
    )
    stale = (
        sa.select(t.trace_id)
        .where(t.state == TraceState.REFUSED.value,
               t.last_span_at <= now - timedelta(seconds=max_wait))
        .limit(limit)
    )
    forgotten = 0
    for picked, was, becomes in ((final, TraceState.ASSEMBLED, TraceState.SENT),
                                 (stale, TraceState.REFUSED, TraceState.DROPPED)):
        moved = await conn.execute(
            TRACE_STATES.move(becomes, expected=[was])
            .where(t.trace_id.in_(picked.scalar_subquery()))
            .returning(t.trace_id)
        )
        trace_ids = list(moved.scalars())
        if trace_ids:
            await conn.execute(sa.delete(OTLP_SPANS).where(OTLP_SPANS.c.trace_id.in_(trace_ids)))
        forgotten += len(trace_ids)
    return forgotten


# How many of the reasons traces were refused for /v1/stats lists, the commonest first.
SHOWN_REFUSALS = 20


async def counts(conn: AsyncConnection) -> dict[str, Any]:
    """For /v1/stats: traces by assembly state, spans received, spans that came late,
    and why traces were refused (each reason says what the sender should change)."""
    t = OTLP_TRACES.c
    # sent counts as assembled, dropped as refused: their spans are gone, not their fate.
    states, spans, late = await TRACE_ASSEMBLY.tally(
        conn, t.spans, {TraceState.SENT: TraceState.ASSEMBLED,
                        TraceState.DROPPED: TraceState.REFUSED})
    out = {f"{state}_traces": states[state] for state in ("open", "assembled", "refused")}
    out.update(spans=spans, late_spans=late)
    refused = (TraceState.REFUSED.value, TraceState.DROPPED.value)
    reasons = await conn.execute(
        sa.select(t.error, sa.func.count().label("traces"))
        .where(t.state.in_(refused), t.error.is_not(None))
        .group_by(t.error).order_by(sa.func.count().desc(), t.error).limit(SHOWN_REFUSALS)
    )
    figures: dict[str, Any] = dict(out)
    figures["refusals"] = [{"reason": reason, "traces": n} for reason, n in reasons]
    return figures
