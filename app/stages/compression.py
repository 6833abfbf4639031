"""The compression stage: claim accepted traces, compress them, store the result
beside the original, and move each to `compressed` or `compression_skipped`.

A claim is a lease (app/stages/leases.py): a worker killed mid-trace leaves a lease that
expires, and the next worker compresses the trace; the final move checks the lease,
so a trace is compressed (stored) at most once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.compression import Compressed, Skipped, Summarizer, compress
from app.config import CompressionConfig
from app.db.models import TRACES
from app.db.moves import TRACE_STAGES
from app.domain import Stage, Trace
from app.llm import LLMError
from app.stages.leases import RELEASED, Lease, claim, held_by, retry_later

log = logging.getLogger("atropos.compression")


class CompressionStage:
    name = "compression"

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
    ) -> None:
        self._engine = engine
        self._policy = policy
        self._max_trace_tokens = max_trace_tokens
        self._lease = lease
        self._summarizer = summarizer
        # summarize_middle waits on the model for each trace: a small claim, committed
        # trace by trace, stays well inside the lease. key_decision_extract takes a few
        # ms a trace: a larger claim, committed in one transaction, so that the fsync
        # per commit does not cap the stage below the ingest rate.
        self._model_bound = policy.strategy == "summarize_middle"
        self._batch = batch or (8 if self._model_bound else 32)
        self._on_advance = on_advance

    async def run_once(self) -> int:
        async with self._engine.begin() as conn:
            rows = await claim(
                conn,
                TRACES,
                where=TRACES.c.stage == Stage.ACCEPTED.value,
                order_by=TRACES.c.created_at,
                limit=self._batch,
                lease=self._lease,
                returning=[
                    TRACES.c.trace_id,
                    TRACES.c.trace,
                    TRACES.c.total_tokens,
                    TRACES.c.reward,
                    TRACES.c.reward_breakdown,
                    TRACES.c.attempts,
                ],
            )
        if self._model_bound:
            # Mostly waiting on the model: stays on the event loop with its HTTP client.
            for row in rows:
                await self._write([(row, await self._outcome(row))])
        else:
            # key_decision_extract is pure CPU (tens of ms for a long trace): run the
            # group off the event loop so the API keeps answering. It makes no I/O, so a
            # private loop in the worker thread is enough.
            outcomes = await asyncio.to_thread(asyncio.run, self._outcomes(rows))
            await self._write(list(zip(rows, outcomes)))
        if rows and self._on_advance is not None:
            self._on_advance()
        return len(rows)

    async def _outcomes(self, rows: list[Any]) -> list[Compressed | Skipped | Exception]:
        return [await self._outcome(row) for row in rows]

    async def _outcome(self, row: Any) -> Compressed | Skipped | Exception:
        try:
            return await self._compress(row)
        except Exception as exc:  # a strategy or model failure sinks only this trace
            return exc

    async def _write(self, outcomes: list[tuple[Any, Compressed | Skipped | Exception]]) -> None:
        async with self._engine.begin() as conn:
            for row, result in outcomes:
                if isinstance(result, Exception):
                    await self._failed(conn, row, result)
                elif isinstance(result, Skipped):
                    # One per trace: detail for DEBUG, not news for INFO.
                    log.debug("compression skipped: trace %s: %s", row.trace_id, result.reason,
                              extra={"trace_id": row.trace_id})
                    await self._move(conn, row.trace_id, Stage.COMPRESSION_SKIPPED,
                                     compression={"skipped": result.reason})
                else:
                    await self._move(
                        conn,
                        row.trace_id,
                        Stage.COMPRESSED,
                        compressed=result.trace.model_dump(mode="json", exclude_none=True),
                        compressed_tokens=result.tokens_after,
                        compression=result.record(),
                    )

    async def _compress(self, row: Any) -> Compressed | Skipped:
        return await compress(
            Trace.model_validate(row.trace),
            row.total_tokens,
            self._policy,
            # The summarizer's HTTP client lives on the event loop; only summarize_middle,
            # which runs there, may use it.
            summarizer=self._summarizer if self._model_bound else None,
            forced=row.total_tokens > self._max_trace_tokens,
            reward=row.reward,
            breakdown=row.reward_breakdown,
        )

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

    async def _failed(self, conn: AsyncConnection, row: Any, exc: Exception) -> None:
        error = f"{type(exc).__name__}: {exc}"
        policy = self._policy.retry
        delay = await retry_later(
            conn, TRACES, row.trace_id, row.attempts, lease=self._lease, policy=policy,
            give_up=TRACE_STAGES.move(Stage.COMPRESSION_FAILED, expected=[Stage.ACCEPTED]),
            wake=self._on_advance, stage_error=error,
        )
        # The model's failures are said in one line; anything else is a bug in a
        # strategy, logged with its traceback.
        trace = None if isinstance(exc, LLMError) else exc
        if delay is None:
            log.error("trace %s: compression failed %d times, giving up: %s",
                      row.trace_id, row.attempts, error, exc_info=trace)
        else:
            log.warning("trace %s: compression failed (attempt %d of %d), retrying in "
                        "%.1f s: %s", row.trace_id, row.attempts, policy.max_attempts,
                        delay, error, exc_info=trace)
