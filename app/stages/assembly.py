"""The assembly stage: the spans of each OTLP trace that has come due become one
trajectory, which goes through the ingest pipeline as any trace does (parsed by the
otlp format, scored, filtered, its tokens counted, in the ingest processes) and is
stored under the trace's id.

A trace is due once its root span has ended and no span has come for
otlp.quiet_seconds, or otlp.max_wait_seconds after its first span. Every step is in
the database (app/ingest/otlp/store.py): spans acknowledged before a crash are
assembled after the restart, and the trajectory and the trace's assembly state are
written in one transaction. A trace that receives spans again is assembled again: its
trajectory is replaced and scored again (its background stages start over) unless it
was batched already; then the new spans are kept and counted as late.

Once a trajectory is batched (or deleted), the spans it was made of are deleted from
otlp_spans: its original holds them. Those of refused traces go otlp.max_wait_seconds
after their last span.

A bare instrumented client sends each model call as a trace of its own. A call whose
messages continue the conversation of a call before it (app/formats/stitching.py, as
the gateway stitches calls) joins that call's run: the run's trajectory is made again
from the spans of all its calls, and the joining trace makes none of its own. A run
whose trajectory was batched is not joined any more: the next call starts a new one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.config import OtlpConfig
from app.db import search
from app.db.assembly import FINAL_STAGES, Due
from app.db.dialect import writing
from app.db.errors import database_error, refuses_row
from app.db.models import PAYLOAD_COLUMNS, PAYLOADS, REVIEWS, TRACES
from app.db.moves import TRACE_STAGES
from app.db.types import utcnow
from app.domain import Stage
from app.errors import HubError
from app.evaluation.redaction import Redacted
from app.formats import otlp
from app.formats.otlp import NAME, wire
from app.ingest.ingestor import count_outcome, count_stored
from app.ingest.inserter import PreparedTrace, insert_traces
from app.ingest.otlp import store
from app.ingest.otlp.store import TRACE_ASSEMBLY

log = logging.getLogger("atropos.otlp")

Prepare = Callable[[list[Any], str | None], Awaitable[list[PreparedTrace | HubError]]]
# Wakes the stages that take on traces which entered these stages (StageRunner.take_on).
TakeOn = Callable[[Iterable[str]], None]
# What a re-assembled trajectory's background stages had made of its previous version
# (its compressed payload too: `outcome`).
_STARTED_OVER = {
    "compression": None,
    "stage_error": None,
    "lease_owner": None,
    "lease_expires_at": None,
}
# How often, at most, the spans no trajectory needs any more are deleted: every few
# quiet periods, and at least every half minute.
FORGET_EVERY_QUIET_PERIODS = 3
FORGET_EVERY_SECONDS = 30
# The longest a failing pass waits before the next is tried.
BACKOFF_MAX_SECONDS = 30.0


@dataclass(slots=True)
class _Pass:
    """Traces come due, read, and their trajectories in preparation (`made`: each
    item of `todo`'s row or refusal)."""

    due: list[Due]
    stored: dict[str, Any]  # their trajectories already stored
    todo: list[str]  # those to make (again)
    made: asyncio.Future[list[PreparedTrace | HubError]]
    joins: dict[str, str]  # a due bare call -> the run it joined
    calls: dict[str, tuple[str | None, str | None]]  # bare calls: (continues, joined)


class AssemblyStage:
    name = "assembly"

    def __init__(
        self,
        engine: AsyncEngine,
        config: OtlpConfig,
        prepare: Prepare,
        *,
        batch: int = 256,
        on_advance: TakeOn | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._config = config
        self._prepare = prepare  # Ingestor.prepare: the ingest pipeline but the insert
        self._batch = batch
        self._on_advance = on_advance
        self._clock = clock  # monotonic seconds: when passes are due again
        self._forgot_at = 0.0
        self._next: _Pass | None = None  # the batch in preparation
        self._failures = 0  # passes failed in a row
        self._retry_at = 0.0  # the clock's time before which no pass is tried
        # Refusal reasons warned of: once each (a reason names its service), then INFO.
        self._warned: set[str] = set()

    @property
    def poll_seconds(self) -> float:
        """How often to look for traces come due: a trajectory appears at most this
        long after it is due."""
        return min(1.0, self._config.quiet_seconds / 4)

    async def run_once(self) -> int:
        """Writes the traces prepared meanwhile, once the next ones are being prepared:
        the ingest processes work on one batch while the serving process writes the
        other (done in turn, each waited for the other, and both were half idle).

        A pass that fails is not tried again at once: the passes after it wait 1 s, then
        twice as long each time, up to BACKOFF_MAX_SECONDS (woken or not), so that a
        failure that lasts costs little."""
        if self._clock() < self._retry_at:
            return 0
        try:
            advanced = await self._pass()
        except Exception:
            self._failures += 1
            delay = min(BACKOFF_MAX_SECONDS, 2.0 ** (self._failures - 1))
            self._retry_at = self._clock() + delay
            raise
        self._failures, self._retry_at = 0, 0.0
        return advanced

    async def _pass(self) -> int:
        current, self._next = self._next, None
        if current is None:
            current = await self._look(exclude=[])
            if current is None:
                return await self._forget()
        made = await current.made
        self._next = await self._look(exclude=[d.id for d in current.due])
        try:
            await self._write(current, made)
        except SQLAlchemyError as exc:
            if not refuses_row(exc):
                raise  # the database failing: the pass is tried again
            # A row the database will not take, whichever it is, refuses its trace
            # alone, never every pass after it.
            await self._write(current, await self._refused_by_database(current, made))
        return len(current.due)

    async def _refused_by_database(
        self, current: _Pass, made: list[PreparedTrace | HubError]
    ) -> list[PreparedTrace | HubError]:
        """`made`, with the rows the database refuses made refusals: each trace's
        writes tried alone, in a savepoint, and all of them rolled back."""
        sorted_out = list(made)
        async with self._engine.connect() as conn:
            trial = await conn.begin()
            try:
                for index, (trace_id, row) in enumerate(zip(current.todo, made)):
                    if isinstance(row, HubError):
                        continue
                    try:
                        async with conn.begin_nested():
                            new = await conn.run_sync(insert_traces, [row])
                            await outcome(conn, trace_id, row.row(), row.search_text,
                                          current.stored.get(trace_id), new)
                    except SQLAlchemyError as exc:
                        if not refuses_row(exc):
                            raise
                        sorted_out[index] = database_error(exc)
            finally:
                await trial.rollback()
        return sorted_out

    async def settle(self) -> None:
        """(`Concurrent`) Nothing is left unwritten between passes that drain() waits for:
        a pass that finds nothing due has nothing in preparation either."""

    async def close(self) -> None:
        """The batch in preparation is dropped: its traces stay open, and due."""
        if self._next is not None:
            self._next.made.cancel()
            await asyncio.gather(self._next.made, return_exceptions=True)
            self._next = None

    async def _look(self, exclude: list[str]) -> _Pass | None:
        """The next traces due (but those in `exclude`), their spans read, and their
        preparation started."""
        async with self._engine.connect() as conn:
            due = await store.due(
                conn, utcnow(), self._config.quiet_seconds, self._config.max_wait_seconds,
                self._batch, exclude,
            )
            if not due:
                return None
            stored = await stored_trajectories(conn, [d.id for d in due])
            todo = to_make([d.id for d in due], stored, NAME)
            config = self._config
            spans = await store.spans_of(
                conn, todo, max_spans=config.max_spans_per_trace,
                max_bytes=config.max_bytes_per_trace, budget=config.max_bytes_per_trace)
            # Those the pass has no room for are left open, and due: the next pass
            # reads them.
            due = [d for d in due if d.id in spans or d.id not in todo]
            todo = [trace_id for trace_id in todo if trace_id in spans]
            joins, calls = await _bare_calls(conn, todo, stored, spans)
            runs = [t for t in todo if t not in joins]
            others = [r for r in dict.fromkeys(joins.values()) if r not in todo]
            stored.update(await stored_trajectories(conn, others))
            members = await store.joined_to(conn, runs + others)
            unread = others + [m for ms in members.values() for m in ms if m not in spans]
            spans.update(await store.spans_of(
                conn, unread, max_spans=config.max_spans_per_trace,
                max_bytes=config.max_bytes_per_trace,
                budget=config.max_bytes_per_trace * max(1, len(unread))))
        runs += others
        for trace_id, run in joins.items():
            members.setdefault(run, []).append(trace_id)
        whole = {run: _together([spans[run], *(spans[m] for m in members.get(run, [])
                                               if m in spans)]) for run in runs}
        # The spans' secrets went before they were stored: their counts go with them.
        items = [Redacted(wire.join(_groups(whole[run].spans)),
                          dict(whole[run].redactions), self._truncated(whole[run]))
                 for run in runs]
        made = asyncio.ensure_future(self._prepare(items, NAME))
        return _Pass(due, stored, runs, made, joins, calls)

    def _truncated(self, spans: store.TraceSpans) -> dict[str, Any]:
        """The trajectory's mark when spans of its trace were left out of it."""
        if not spans.left_out:
            return {}
        return {"truncated": {
            "spans_left_out": spans.left_out,
            "reason": f"a trajectory is made of at most otlp.max_spans_per_trace "
                      f"({self._config.max_spans_per_trace}) spans and "
                      f"otlp.max_bytes_per_trace ({self._config.max_bytes_per_trace}) "
                      "bytes of them, the first by start time",
        }}

    async def _write(self, current: _Pass, made: list[PreparedTrace | HubError]) -> None:
        due = current.due
        runs = [d.id for d in due if d.id not in current.joins]
        runs += [r for r in current.todo if r not in runs]
        async with writing(self._engine) as conn:
            written = await write_trajectories(conn, runs, current.todo, made,
                                               current.stored, NAME)
            of_run = dict(zip(runs, written.outcomes))
            settled = TRACE_ASSEMBLY.settled(
                due, {d.id: of_run[current.joins.get(d.id, d.id)] for d in due})
            for s in settled:
                if s.error is not None:
                    self._refused(s.id, s.error)
            await TRACE_ASSEMBLY.settle(conn, settled)
            await store.note_calls(conn, {s.id: current.calls[s.id]
                                          for s in settled if s.id in current.calls})
        written.report(log, f"OTLP: {len(due)} traces", NAME, self._on_advance)

    def _refused(self, trace_id: str, reason: str) -> None:
        """Every refusal in the log; a WARNING the first time a service's traces are
        refused for a reason, not once per trace of an agent that sends thousands."""
        log.info("OTLP trace %s makes no trajectory: %s", trace_id, reason)
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("OTLP traces make no trajectory (e.g. %s): %s; warned once, "
                        "/v1/stats otlp.refusals counts them", trace_id, reason)

    async def _forget(self) -> int:
        """Now and then, when nothing is due: delete the spans no trajectory needs."""
        every = min(FORGET_EVERY_SECONDS, FORGET_EVERY_QUIET_PERIODS * self._config.quiet_seconds)
        if self._clock() - self._forgot_at < every:
            return 0
        async with writing(self._engine) as conn:
            forgotten = await store.forget(conn, utcnow(), self._config.max_wait_seconds,
                                           limit=1000)
        if forgotten < 1000:
            self._forgot_at = self._clock()  # else: more to do, at once
        if forgotten:
            log.info("OTLP: the spans of %d traces deleted (batched, deleted or refused)",
                     forgotten)
        return forgotten


@dataclass(slots=True)
class Written:
    """What became of each trace come due (`outcome`), in order, and the rows of those
    stored new."""

    outcomes: list[tuple[str, str | None]]
    new: set[str]
    rows: dict[str, PreparedTrace | HubError]

    def counted(self, fmt: str) -> Counter[str]:
        """The outcomes, counted; the traces made (received, as far as the metrics go,
        once made) and refused are counted in the ingest metrics too."""
        for trace_id in self.new:
            row = self.rows[trace_id]
            assert not isinstance(row, HubError)
            count_stored(row, fmt)
        outcomes = Counter(what for what, _ in self.outcomes)
        for _ in range(outcomes["refused"]):
            count_outcome(fmt, "refused")
        return outcomes

    def report(self, log: logging.Logger, assembled: str, fmt: str,
               on_advance: TakeOn | None) -> None:
        """The outcomes counted (`counted`) and logged (`assembled`: how many of
        what); `on_advance` called with the stages the trajectories made or made again
        entered, for the stages after this one (StageRunner.take_on)."""
        outcomes = self.counted(fmt)
        log.info("%s assembled (%s)", assembled,
                 ", ".join(f"{n} {what}" for what, n in sorted(outcomes.items())))
        entered = [row.stage for trace_id in self.new
                   if not isinstance(row := self.rows[trace_id], HubError)]
        if outcomes["replaced"]:  # made again: they start over (`outcome`)
            entered.append(Stage.ACCEPTED.value)
        if entered and on_advance is not None:
            on_advance(entered)


def to_make(due: list[str], stored: dict[str, Any], fmt: str) -> list[str]:
    """Those of `due` whose trajectory is to be made (again): none stored yet, or one
    of `fmt` not batched yet (one of another format is not replaced; `outcome` says
    why)."""
    return [i for i in due if i not in stored
            or (stored[i].source_format == fmt and stored[i].stage not in FINAL_STAGES)]


async def write_trajectories(
    conn: AsyncConnection, due: list[str], todo: list[str],
    made: list[PreparedTrace | HubError], stored: dict[str, Any], fmt: str,
) -> Written:
    """Store the trajectories made for `todo` (new ones inserted, others replaced, in
    `conn`'s transaction) and say what became of each trace of `due`."""
    prepared = dict(zip(todo, made))
    rows = {trace_id: r if isinstance(r, HubError) else r.row()
            for trace_id, r in prepared.items()}
    texts = {trace_id: r.search_text for trace_id, r in prepared.items()
             if not isinstance(r, HubError)}
    new = await conn.run_sync(insert_traces, [r for r in made if not isinstance(r, HubError)])
    outcomes = [await outcome(conn, trace_id, rows.get(trace_id), texts.get(trace_id),
                              stored.get(trace_id), new, fmt) for trace_id in due]
    return Written(outcomes, new, prepared)


async def outcome(
    conn: AsyncConnection,
    trace_id: str,
    row: dict[str, Any] | HubError | None,
    text: search.SearchText | None,
    stored: Any,
    new: set[str],
    fmt: str = NAME,
) -> tuple[str, str | None]:
    """What became of a trace come due (`text`: its search text), and why it makes no
    trajectory if it does not:
    new | replaced (scored again) | unchanged | late (batched already: kept as it is) |
    refused | again (its trajectory moved meanwhile: it stays due)."""
    if stored is not None and stored.source_format != fmt:
        return "refused", (f"trace_id {trace_id} is already stored, from another format; "
                           f"what {fmt} received for it is kept but makes no trajectory")
    if row is None or (stored is not None and stored.stage in FINAL_STAGES):
        return "late", None
    if isinstance(row, HubError):
        return "refused", row.message
    if trace_id in new:
        return "new", None
    if stored is None:
        return "again", None  # made by another process since the look above
    if stored.content_hash == row["content_hash"]:
        return "unchanged", None  # assembled again from the same spans (after a restart)
    c = TRACES.c
    current, target = Stage(stored.stage), Stage(row["stage"])
    if target is not Stage.REJECTED:
        # A trajectory made again starts its stages over from `accepted` (the moves the
        # stage machine has from where it was), even one a new trace would enter past.
        target = Stage.ACCEPTED
    payloads = {k: row[k] for k in ("original", "trace")}
    content = {k: v for k, v in row.items()
               if k not in ("trace_id", "created_at", "stage", *PAYLOAD_COLUMNS, *_STARTED_OVER)}
    # A reviewer's reward override wins over the new score, as it did over the old one
    # (the review itself, label and note, is a row of its own and stays).
    override = sa.select(REVIEWS.c.reward).where(REVIEWS.c.trace_id == trace_id)
    content["reward"] = sa.func.coalesce(override.scalar_subquery(), content["reward"])
    # A move of the trace's stage (app/db/moves.py), unless it stays where it is.
    update = (sa.update(TRACES).where(c.stage == current.value) if current is target
              else TRACE_STAGES.move(target, expected=[current]))
    replaced = await conn.execute(
        update.where(c.trace_id == trace_id).values(**content, **_STARTED_OVER)
    )
    if replaced.rowcount == 1:
        await conn.execute(sa.update(PAYLOADS).where(PAYLOADS.c.trace_id == trace_id)
                           .values(**payloads, compressed=None))
        if text is not None:
            await conn.run_sync(search.index, [(trace_id, text)])
        return "replaced", None
    # Its stage moved since the look above: batched (then these spans are late), or on
    # through the pipeline (then the next round replaces it).
    stage = await conn.scalar(sa.select(c.stage).where(c.trace_id == trace_id))
    return ("late" if stage in FINAL_STAGES else "again"), None


async def stored_trajectories(conn: AsyncConnection, trace_ids: list[str]) -> dict[str, Any]:
    """The trajectories already stored under these ids: their stage and format."""
    c = TRACES.c
    rows = await conn.execute(
        sa.select(c.trace_id, c.stage, c.source_format, c.content_hash)
        .where(c.trace_id.in_(trace_ids))
    )
    return {row.trace_id: row for row in rows}


async def _bare_calls(
    conn: AsyncConnection, todo: list[str], stored: dict[str, Any],
    spans: dict[str, store.TraceSpans],
) -> tuple[dict[str, str], dict[str, tuple[str | None, str | None]]]:
    """Which of `todo` are bare clients' model calls, and the run each one joins: a
    call of this pass before it, else an assembled one, whose conversation it
    continues. Returns (trace -> the run it joins, trace -> (continues, joined))."""
    joins: dict[str, str] = {}
    calls: dict[str, tuple[str | None, str | None]] = {}
    in_pass: dict[str, str] = {}  # continuation digest -> run, of this pass's calls
    for trace_id in todo:
        if trace_id in stored or len(spans[trace_id].spans) != 1:
            continue
        call = otlp.bare_call(otlp.load(wire.join(_groups(spans[trace_id].spans))))
        if call is None:
            continue
        run = next((in_pass[p] for p in call.prefixes if p in in_pass), None)
        if run is None:
            run = await store.run_continued(conn, call.prefixes)
            if run is not None and not await _open_run(conn, run):
                run = None
        if run is not None and run != trace_id:
            joins[trace_id] = run
        if call.continues is not None:
            in_pass[call.continues] = joins.get(trace_id, trace_id)
        calls[trace_id] = (call.continues, joins.get(trace_id))
    return joins, calls


async def _open_run(conn: AsyncConnection, run: str) -> bool:
    """Whether a run's trajectory may still take calls: an OTLP one, not batched."""
    found = (await stored_trajectories(conn, [run])).get(run)
    return found is not None and found.source_format == NAME \
        and found.stage not in FINAL_STAGES


def _together(parts: list[store.TraceSpans]) -> store.TraceSpans:
    """The spans of a run's traces (each in start order) as one trace's."""
    whole = store.TraceSpans()
    for part in parts:
        whole.spans += part.spans
        whole.redactions.update(part.redactions)
        whole.size += part.size
        whole.left_out += part.left_out
    return whole


def _groups(spans: list[tuple[bytes, bytes, bytes]]) -> list[tuple[bytes, bytes, list[bytes]]]:
    """Spans by the resource and scope they came with, each group in start order."""
    groups: dict[tuple[bytes, bytes], list[bytes]] = {}
    for resource, scope, span in spans:
        groups.setdefault((resource, scope), []).append(span)
    return [(resource, scope, members) for (resource, scope), members in groups.items()]
