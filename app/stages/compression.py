"""The compression stage: claim accepted traces, compress them, store the result
beside the original, and move each to `compressed` or `compression_skipped`.

A claim is a lease (app/stages/leases.py): a worker killed mid-trace leaves a lease that
expires, and the next worker compresses the trace; the final move checks the lease,
so a trace is compressed (stored) at most once. A heartbeat renews the leases of the
traces being worked on, so that a slow model does not lose a trace to a second worker
(which would summarize it again).

summarize_middle waits on the model, so its calls run concurrently, at most
`compression.max_concurrent_calls` at a time, each written when it is done; traces
that need no call (skips) are claimed apart and written at once, so a hanging model
holds up no trace that does not need it. key_decision_extract is CPU work: a batch of
traces at a time, off the event loop.

While the model fails, a trace is retried by `compression.retry`; after its last
attempt it is `compression_failed`, or compressed with key_decision_extract when
`compression.on_model_failure` is `fallback`. An outage is logged at WARNING once,
when it begins, and once more (INFO) when the model answers again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.compression import (
    Compressed,
    Skipped,
    Summarizer,
    compress,
    compression_target,
    smallest_compressed,
)
from app.config import CompressionConfig
from app.db.dialect import OneHop, writing
from app.db.errors import outage_of
from app.db.models import PAYLOADS, TRACES
from app.db.moves import RELEASED, TRACE_STAGES
from app.domain import Stage, Trace
from app.llm import LLMError, model_outage
from app.metrics import COMPRESSIONS, count_compressed, count_compression_skipped
from app.outage import Outage
from app.stages import COMPRESSION
from app.stages.leases import Heartbeat, Lease, claim, held_by, retry_later

log = logging.getLogger("atropos.compression")

Outcome = Compressed | Skipped | Exception


class _Claimed(NamedTuple):
    """A claimed trace, its canonical payload read beside the claim."""

    trace_id: str
    trace: dict[str, Any]
    total_tokens: int
    reward: float | None
    reward_breakdown: dict[str, Any] | None
    attempts: int


class CompressionStage:
    name = COMPRESSION

    def __init__(
        self,
        engine: AsyncEngine,
        policy: CompressionConfig,
        *,
        max_trace_tokens: int,
        lease: Lease,
        summarizer: Summarizer | None = None,
        batch: int | None = None,
        on_advance: Callable[[], None] | None = None,
        model: Outage | None = None,
        writer: OneHop | None = None,
    ) -> None:
        """`model`: where the summary model failing is said (the hub's); `writer`: the
        hub's one (without it, one of the stage's own)."""
        self._engine = engine
        self._writer = writer or OneHop(engine)
        self._policy = policy
        self._max_trace_tokens = max_trace_tokens
        self._lease = lease
        self._summarizer = summarizer
        # A claim of key_decision_extract's (or of skips) is committed in one
        # transaction, so that the fsync per commit does not cap the stage below the
        # ingest rate.
        self._batch = batch or 32
        self._on_advance = on_advance
        self._heartbeat = Heartbeat(
            engine, TRACES, lease,
            lost="trace %s: lease lost while compressing it; left to its new owner",
        )
        self._model_bound = policy.strategy == "summarize_middle"
        # Traces this small need no model call: claimed apart from those that do.
        self._calls_from = smallest_compressed(policy, max_trace_tokens)
        self._calls: set[asyncio.Task[None]] = set()
        self._call_slots = asyncio.Semaphore(policy.max_concurrent_calls)
        self._model = model or model_outage(policy)

    async def run_once(self) -> int:
        if not self._model_bound:
            rows = await self._claim(self._batch)
            # key_decision_extract is pure CPU (tens of ms for a long trace): run the
            # group off the event loop so the API keeps answering. It makes no I/O, so a
            # private loop in the worker thread is enough.
            with self._heartbeat.holding(row.trace_id for row in rows):
                # The coroutine is made in the thread: made here, it would never be
                # awaited if the stage stopped before the thread took it.
                outcomes = await asyncio.to_thread(lambda: asyncio.run(self._outcomes(rows)))
                await self._write(list(zip(rows, outcomes)))
            self._advanced(len(rows))
            return len(rows)
        calls_from = self._calls_from
        light = await self._claim(
            self._batch, None if calls_from is None else TRACES.c.total_tokens < calls_from
        )
        at_once = [row for row in light if not self._calls_model(row)]
        with self._heartbeat.holding(row.trace_id for row in at_once):
            await self._write([(row, await self._outcome(row)) for row in at_once])
        self._advanced(len(at_once))
        free = self._policy.max_concurrent_calls - len(self._calls)
        heavy = []
        if calls_from is not None and free > 0:
            heavy = await self._claim(free, TRACES.c.total_tokens >= calls_from)
        # A light trace that needs the model after all (the size is only a hint) goes
        # with the heavy ones; the semaphore bounds the calls either way.
        for row in [*heavy, *(row for row in light if self._calls_model(row))]:
            task = asyncio.create_task(self._call(row), name=f"compress-{row.trace_id}")
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)
        return len(light) + len(heavy)

    async def settle(self) -> None:
        """Wait for the model calls in flight."""
        while self._calls:
            await asyncio.gather(*self._calls, return_exceptions=True)

    async def close(self) -> None:
        """Abandon the calls in flight: their leases run out and another worker (or
        this one, restarted) compresses those traces."""
        for task in self._calls:
            task.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)

    async def _claim(self, limit: int, where: sa.ColumnElement[bool] | None = None) -> list[Any]:
        return await self._writer.run(partial(self._claimed, limit, where))

    def _claimed(self, limit: int, where: sa.ColumnElement[bool] | None,
                 conn: sa.Connection) -> list[_Claimed]:
        """`_claim`'s transaction, in the hub's writer."""
        condition = TRACES.c.stage == Stage.ACCEPTED.value
        rows = claim(
            conn,
            TRACES,
            where=condition if where is None else sa.and_(condition, where),
            order_by=TRACES.c.created_at,
            limit=limit,
            lease=self._lease,
            longest_backoff=self._policy.retry.max_seconds,
            returning=[
                TRACES.c.trace_id,
                TRACES.c.total_tokens,
                TRACES.c.reward,
                TRACES.c.reward_breakdown,
                TRACES.c.attempts,
            ],
        )
        if not rows:
            return []
        traces = {p.trace_id: p.trace for p in conn.execute(
            sa.select(PAYLOADS.c.trace_id, PAYLOADS.c.trace)
            .where(PAYLOADS.c.trace_id.in_([row.trace_id for row in rows])))}
        # SQLite's RETURNING gives a whole REAL (a reward of 0.0) as an integer: the
        # compressed trace keeps the reward as it is stored, a float on both databases.
        return [_Claimed(row.trace_id, traces[row.trace_id], row.total_tokens,
                         None if row.reward is None else float(row.reward),
                         row.reward_breakdown, row.attempts) for row in rows]

    async def _call(self, row: Any) -> None:
        try:
            with self._heartbeat.holding([row.trace_id]):
                async with self._call_slots:
                    outcome = await self._outcome(row)
                await self._write([(row, outcome)])
        except Exception as exc:  # the trace stays leased until then
            if not outage_of(self._engine).failed(exc, "storing a compression"):
                log.exception("trace %s: storing its compression failed; its lease runs out "
                              "and it is compressed again", row.trace_id)
            return
        self._advanced(1)

    def _advanced(self, traces: int) -> None:
        if traces and self._on_advance is not None:
            self._on_advance()

    def _calls_model(self, row: Any) -> bool:
        forced = row.total_tokens > self._max_trace_tokens
        return not isinstance(compression_target(row.total_tokens, self._policy, forced), Skipped)

    async def _outcomes(self, rows: list[Any]) -> list[Outcome]:
        return [await self._outcome(row) for row in rows]

    async def _outcome(self, row: Any) -> Outcome:
        try:
            return await self._compress(row)
        except Exception as exc:  # a strategy or model failure sinks only this trace
            return exc

    async def _compress(self, row: Any) -> Compressed | Skipped:
        policy = self._policy
        last = row.attempts >= policy.retry.max_attempts
        return await compress(
            Trace.model_validate(row.trace),
            row.total_tokens,
            policy,
            # The summarizer's HTTP client lives on the event loop; only summarize_middle,
            # which runs there, may use it.
            summarizer=self._summarizer if self._model_bound else None,
            fall_back=last and policy.on_model_failure == "fallback",
            forced=row.total_tokens > self._max_trace_tokens,
            reward=row.reward,
            breakdown=row.reward_breakdown,
        )

    async def _write(self, outcomes: list[tuple[Any, Outcome]]) -> None:
        if not outcomes:
            return
        finished: list[Compressed | Skipped] = []
        gave_up = 0
        async with writing(self._engine) as conn:
            for row, result in outcomes:
                if isinstance(result, Exception):
                    gave_up += await self._failed(conn, row, result)
                elif isinstance(result, Skipped):
                    # One per trace: detail for DEBUG; the periodic INFO summary counts
                    # them by kind (app/metrics.py).
                    log.debug("compression skipped: trace %s: %s", row.trace_id, result.reason,
                              extra={"trace_id": row.trace_id})
                    if await self._move(conn, row.trace_id, Stage.COMPRESSION_SKIPPED,
                                        compression={"skipped": result.reason}):
                        finished.append(result)
                else:
                    if result.model_failed:
                        assert result.fallback is not None
                        self._model.failed(result.fallback, f"summarizing trace {row.trace_id}")
                        log.debug("trace %s: compressed with key_decision_extract: %s",
                                  row.trace_id, result.fallback)
                    elif result.strategy == "summarize_middle":
                        self._model.works()
                    if await self._move(
                        conn,
                        row.trace_id,
                        Stage.COMPRESSED,
                        compressed_tokens=result.tokens_after,
                        compression=result.record(),
                    ):
                        await conn.execute(
                            sa.update(PAYLOADS).where(PAYLOADS.c.trace_id == row.trace_id)
                            .values(compressed=result.trace.model_dump(mode="json",
                                                                       exclude_none=True)))
                        finished.append(result)
        _count(finished, gave_up)

    async def _move(
        self, conn: AsyncConnection, trace_id: str, target: Stage, **values: Any
    ) -> bool:
        result = await conn.execute(
            TRACE_STAGES.move(target, expected=[Stage.ACCEPTED])
            .where(TRACES.c.trace_id == trace_id, held_by(TRACES, self._lease))
            .values(stage_error=None, **RELEASED, **values)
        )
        moved = result.rowcount == 1
        if not moved:
            log.warning("trace %s: lease lost before the move to %s; left to its new owner",
                        trace_id, target.value)
        return moved

    async def _failed(self, conn: AsyncConnection, row: Any, exc: Exception) -> bool:
        """Retry later, or give up (True)."""
        error = f"{type(exc).__name__}: {exc}"
        policy = self._policy.retry
        delay = await retry_later(
            conn, TRACES, row.trace_id, row.attempts, lease=self._lease, policy=policy,
            give_up=TRACE_STAGES.move(Stage.COMPRESSION_FAILED, expected=[Stage.ACCEPTED]),
            wake=self._on_advance, stage_error=error,
        )
        if isinstance(exc, LLMError):
            # Said once per outage (app/outage.py); each trace's turn in one line.
            self._model.failed(exc, f"summarizing trace {row.trace_id}")
            if delay is None:
                log.info("trace %s: the summary model failed %d times, giving up "
                         "(compression_failed): %s", row.trace_id, row.attempts, error)
            else:
                log.debug("trace %s: the summary model failed (attempt %d of %d), retrying "
                          "in %.1f s", row.trace_id, row.attempts, policy.max_attempts, delay)
        elif delay is None:
            # Anything else is a bug in a strategy, logged with its traceback.
            log.error("trace %s: compression failed %d times, giving up: %s",
                      row.trace_id, row.attempts, error, exc_info=exc)
        else:
            log.warning("trace %s: compression failed (attempt %d of %d), retrying in "
                        "%.1f s: %s", row.trace_id, row.attempts, policy.max_attempts,
                        delay, error, exc_info=exc)
        return delay is None


def _count(finished: list[Compressed | Skipped], gave_up: int) -> None:
    """What a committed write finished, in the metrics (app/metrics.py)."""
    if gave_up:
        COMPRESSIONS.labels("failed").inc(gave_up)
    for result in finished:
        if isinstance(result, Skipped):
            count_compression_skipped(result.kind)
        else:
            count_compressed(result.strategy, result.tokens_before, result.tokens_after)
