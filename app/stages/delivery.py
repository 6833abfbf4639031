"""The delivery stage: lease a pending batch, hand it to the target, acknowledge it.

- A lease (app/stages/leases.py) names the worker delivering a batch and is renewed while the
  target works (a training job polls for minutes); a worker that dies leaves a lease
  that expires after workers.lease_seconds, and the batch is deliverable again.
- The acknowledgement (batch `delivered`, its traces `delivered`) is one transaction
  that checks the lease, so a batch is acknowledged exactly once; the target sees
  the same batch_id on every attempt and delivers it once (see app/targets).
- A failed attempt keeps the lease but shortens it to the backoff of
  distributor.retry (leases.retry_later), after which any worker may try again; after
  its max_attempts the batch is `failed` with its last error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.config import DistributorConfig
from app.db.dialect import OneHop, writing
from app.db.models import BATCHES, MEMBERS, PAYLOADS, TRACES, WITH_PAYLOADS
from app.db.moves import BATCH_STATES, RELEASED, TRACE_STAGES
from app.db.types import utcnow
from app.domain import BatchState, Stage, Trace
from app.errors import HubError
from app.formats import gateway as gateway_format
from app.gateway.tokens import token_view
from app.metrics import DELIVERY_ATTEMPTS
from app.outage import Outage, training_outage
from app.stages import DELIVERY
from app.stages.leases import Heartbeat, Lease, claim, held_by, retry_later
from app.targets import Batch, BatchFile, BatchItem, FileTarget, Target
from app.targets.base import render_file

log = logging.getLogger("atropos.delivery")


# The most batches a delivery pass claims and acknowledges together, to a target that
# takes them one after the other.
PER_PASS = 8
# The most traces of a `FileTarget`'s pass, in whole batches: a pass pays a claim, an
# acknowledgement, a directory fsync and a manifest append once for all its batches, so
# a backlog is taken in large passes (its payloads held meanwhile: ~20 MB of 5 KB
# traces).
TRACES_PER_PASS = 4096
# The most tokens of traces a pass holds at once (~32 MB of text): a pass of large
# traces is written in parts of whole batches, each paying its own fsync and append.
TOKENS_PER_PART = 8_000_000


class _Delivered(NamedTuple):
    """A batch the target took, to acknowledge."""

    batch_id: str
    attempts: int
    traces: int
    receipt: dict[str, Any]


class DeliveryStage:
    name = DELIVERY

    def __init__(
        self,
        engine: AsyncEngine,
        target: Target,
        config: DistributorConfig,
        *,
        lease: Lease,
        on_advance: Callable[[], None] | None = None,
        training: Outage | None = None,
        writer: OneHop | None = None,
        prepare: Callable[..., Awaitable[Any]] | None = None,
    ) -> None:
        """`training`: where the training service failing is said (the hub's);
        `writer`: the hub's one (without it, one of the stage's own); `prepare`: where a
        `FileTarget`'s files are rendered, `prepare(work, *args)` (an ingest process
        of their own, `IngestProcesses.apart`; without it, a thread)."""
        self._engine = engine
        self._writer = writer or OneHop(engine)
        self._prepare = prepare or _in_thread
        self._target = target
        self._training = training or training_outage()
        self._config = config
        self._lease = lease
        self._on_advance = on_advance
        self._heartbeat = Heartbeat(
            engine, BATCHES, lease,
            lost="batch %s: lease lost while delivering; another worker may deliver it "
                 "too (same batch_id)",
        )

    @property
    def batch(self) -> int:
        """(ComesDue) the batches a pass claims at most."""
        if isinstance(self._target, FileTarget):
            return max(1, TRACES_PER_PASS // self._config.batch_size)
        return PER_PASS

    async def run_once(self) -> int:
        """Deliver the oldest due batches, in order, up to PER_PASS of them: one claim
        and one acknowledgement (a commit each) for all, rather than two commits a
        batch. A failed attempt ends the pass: the batches after it are released
        untried. A `FileTarget` gets up to TRACES_PER_PASS traces' batches at once (in
        parts of TOKENS_PER_PART tokens), each failing alone.
        0 when none is due."""
        target = self._target
        files = target if isinstance(target, FileTarget) else None
        rows = await self._writer.run(partial(
            claim,
            table=BATCHES,
            where=BATCHES.c.state == BatchState.PENDING.value,
            order_by=BATCHES.c.created_at,
            limit=self.batch,
            lease=self._lease,
            returning=[BATCHES.c.batch_id, BATCHES.c.created_at, BATCHES.c.attempts,
                       BATCHES.c.receipt],
            longest_backoff=self._config.retry.max_seconds,
        ))
        if not rows:
            return 0
        delivered: list[_Delivered] = []
        # Every batch of the pass stays leased until it is acknowledged or released.
        with self._heartbeat.holding(row.batch_id for row in rows):
            if files is not None:
                outcomes = []
                for part in await self._parts(rows):
                    outcomes += await self._write_files(files, part)
                for row, outcome in zip(rows, outcomes, strict=True):
                    if isinstance(outcome, Exception):
                        await self._failed(row.batch_id, row.attempts, outcome)
                    else:
                        delivered.append(outcome)
            else:
                for n, row in enumerate(rows):
                    outcome = await self._attempt(row)
                    if isinstance(outcome, Exception):
                        await self._failed(row.batch_id, row.attempts, outcome)
                        await self._release([later.batch_id for later in rows[n + 1:]])
                        break
                    delivered.append(outcome)
            if await self._acknowledge(delivered) and self._on_advance is not None:
                self._on_advance()
        return len(rows)

    async def _attempt(self, row: Any) -> _Delivered | Exception:
        """Hand one claimed batch to the target: what to acknowledge, or what failed
        (any failure sinks this attempt only; it is recorded on the row)."""
        started = time.monotonic()
        try:
            batch = await self._load(row)
            receipt = await self._target.deliver(
                batch, lambda r: self._save(batch.batch_id, r)
            )
        except Exception as exc:
            self._attempted("failed", started)
            return exc
        self._attempted("delivered", started)
        self._training.works()
        return _Delivered(batch.batch_id, batch.attempts, len(batch.items), receipt)

    async def _parts(self, rows: list[Any]) -> list[list[Any]]:
        """A pass's batches in order, in parts of at most TOKENS_PER_PART tokens (a
        batch at least): each part's payloads and files are held in memory at once."""
        try:
            async with self._engine.connect() as conn:
                tokens = {batch_id: n for batch_id, n in await conn.execute(
                    sa.select(MEMBERS.c.batch_id, sa.func.sum(TRACES.c.total_tokens))
                    .join(TRACES, TRACES.c.trace_id == MEMBERS.c.trace_id)
                    .where(MEMBERS.c.batch_id.in_([row.batch_id for row in rows]))
                    .group_by(MEMBERS.c.batch_id))}
        except sa.exc.SQLAlchemyError:
            return [rows]  # reading their members fails each batch, said on its row
        parts: list[list[Any]] = [[]]
        held = 0
        for row in rows:
            size = tokens.get(row.batch_id) or 0
            if parts[-1] and held + size > TOKENS_PER_PART:
                parts.append([])
                held = 0
            parts[-1].append(row)
            held += size
        return parts

    async def _write_files(self, target: FileTarget,
                           rows: list[Any]) -> list[_Delivered | Exception]:
        """A pass's batches as files: each rendered by `prepare`, then all handed to the
        target at once; what to acknowledge of each, or what failed it."""
        started = time.monotonic()
        try:
            members = await self._members([row.batch_id for row in rows])
        except Exception as exc:
            return [exc for _ in rows]
        rendered = await asyncio.gather(
            *(self._render(row, members.get(row.batch_id, []), target.fmt) for row in rows),
            return_exceptions=True)
        ready = [f for f in rendered if isinstance(f, BatchFile)]
        for f in ready:
            f.say_left_out()
        receipts = iter(await target.write_files(ready) if ready else [])
        outcomes: list[_Delivered | Exception] = []
        for row, got in zip(rows, rendered, strict=True):
            if not isinstance(got, BatchFile):
                if not isinstance(got, Exception):
                    raise got  # cancelled: the pass stops, its leases run out
                outcomes.append(got)
            elif isinstance(receipt := next(receipts), Exception):
                outcomes.append(receipt)
            else:
                outcomes.append(_Delivered(row.batch_id, row.attempts,
                                           len(got.trace_ids) + len(got.left_out), receipt))
        for outcome in outcomes:
            self._attempted("failed" if isinstance(outcome, Exception) else "delivered",
                            started)
        if any(not isinstance(outcome, Exception) for outcome in outcomes):
            self._training.works()
        return outcomes

    async def _render(self, row: Any, members: list[Any], fmt: str) -> BatchFile:
        file: BatchFile = await self._prepare(
            render_file, row.batch_id, row.created_at,
            [(m.trace_id, m.reward, m.payload, bool(m.compressed)) for m in members], fmt)
        return file

    def _attempted(self, result: str, started: float) -> None:
        DELIVERY_ATTEMPTS.labels(self._target.name, result).observe(time.monotonic() - started)

    async def _members(self, batch_ids: list[str]) -> dict[str, list[Any]]:
        """Each batch's traces in order, read with one query for all: trace_id, reward,
        source_format, the payload to send as its JSON text (which pydantic parses and
        validates in one pass, no Python dicts made first) and whether that is the
        compressed view."""
        c, p = TRACES.c, PAYLOADS.c
        use_compressed = self._config.use_compressed
        payload = sa.func.coalesce(p.compressed, p.trace) if use_compressed else p.trace
        compressed = p.compressed.is_not(None) if use_compressed else sa.false()
        query = (
            sa.select(MEMBERS.c.batch_id, c.trace_id, c.reward,
                      sa.cast(payload, sa.Text).label("payload"),
                      compressed.label("compressed"), c.source_format)
            .select_from(WITH_PAYLOADS)
            .join(MEMBERS, MEMBERS.c.trace_id == c.trace_id)
            .where(MEMBERS.c.batch_id.in_(batch_ids))
            .order_by(MEMBERS.c.batch_id, MEMBERS.c.position)
        )
        members: dict[str, list[Any]] = {}
        async with self._engine.connect() as conn:
            for m in await conn.execute(query):
                members.setdefault(m.batch_id, []).append(m)
        return members

    async def _load(self, row: Any) -> Batch:
        members = (await self._members([row.batch_id])).get(row.batch_id, [])
        async with self._engine.connect() as conn:
            captured = await _captured(conn, [m.trace_id for m in members
                                              if m.source_format == gateway_format.NAME])
        items = []
        for m in members:
            items.append(BatchItem(m.trace_id, m.reward, Trace.model_validate_json(m.payload),
                                   bool(m.compressed), tokens=captured.get(m.trace_id)))
        return Batch(row.batch_id, row.created_at, row.attempts, items, row.receipt or {})

    async def _save(self, batch_id: str, receipt: dict[str, Any]) -> None:
        async with writing(self._engine) as conn:
            await conn.execute(
                sa.update(BATCHES)
                .where(BATCHES.c.batch_id == batch_id, held_by(BATCHES, self._lease))
                .values(receipt=receipt, updated_at=utcnow())
            )

    async def _acknowledge(self, delivered: list[_Delivered]) -> bool:
        """Acknowledge the delivered batches whose leases this worker still holds, in
        one transaction in the hub's writer; whether any was."""
        if not delivered:
            return False
        acknowledged = await self._writer.run(partial(self._acknowledged, delivered))
        for batch in acknowledged:
            log.info("batch %s delivered to %s (%d traces, attempt %d)", batch.batch_id,
                     self._target.name, batch.traces, batch.attempts,
                     extra={"batch_id": batch.batch_id})
        return bool(acknowledged)

    def _acknowledged(self, delivered: list[_Delivered],
                      conn: sa.Connection) -> list[_Delivered]:
        """The moves of `_acknowledge`, in its transaction: the batches acknowledged. A
        statement for all the moves and one for all the receipts, not one a batch: a
        PostgreSQL statement is a round trip through the event loop."""
        now = utcnow()
        moved = set(conn.execute(
            BATCH_STATES.move(BatchState.DELIVERED, expected=[BatchState.PENDING])
            .where(BATCHES.c.batch_id.in_([batch.batch_id for batch in delivered]),
                   held_by(BATCHES, self._lease))
            .values(delivered_at=now, updated_at=now, target=self._target.name, **RELEASED)
            .returning(BATCHES.c.batch_id)
        ).scalars())
        acknowledged = []
        for batch in delivered:
            if batch.batch_id not in moved:
                log.warning("batch %s: delivered, but the lease was lost first; its new "
                            "owner acknowledges it", batch.batch_id)
                continue
            acknowledged.append(batch)
        if acknowledged:
            conn.execute(
                sa.update(BATCHES)
                .where(BATCHES.c.batch_id == sa.bindparam("acked_id"))
                .values(receipt=sa.bindparam("acked_receipt", type_=BATCHES.c.receipt.type)),
                [{"acked_id": batch.batch_id, "acked_receipt": batch.receipt}
                 for batch in acknowledged],
            )
        if acknowledged:
            members = sa.select(MEMBERS.c.trace_id).where(
                MEMBERS.c.batch_id.in_([batch.batch_id for batch in acknowledged]))
            conn.execute(
                TRACE_STAGES.move(Stage.DELIVERED, expected=[Stage.BATCHED])
                .where(TRACES.c.trace_id.in_(members))
                .values(updated_at=now)
            )
        return acknowledged

    async def _release(self, batch_ids: list[str]) -> None:
        """Give back claimed batches that were not attempted: free now, their claim's
        attempt not counted."""
        if not batch_ids:
            return
        async with writing(self._engine) as conn:
            await conn.execute(
                sa.update(BATCHES)
                .where(BATCHES.c.batch_id.in_(batch_ids), held_by(BATCHES, self._lease))
                .values(attempts=BATCHES.c.attempts - 1, **RELEASED)
            )

    async def _failed(self, batch_id: str, attempts: int, exc: Exception) -> None:
        error = f"{type(exc).__name__}: {exc}"
        policy = self._config.retry
        async with writing(self._engine) as conn:
            delay = await retry_later(
                conn, BATCHES, batch_id, attempts, lease=self._lease, policy=policy,
                give_up=BATCH_STATES.move(BatchState.FAILED, expected=[BatchState.PENDING]),
                wake=self._on_advance, last_error=error,
            )
        expected = self._training.failed(exc, f"delivering batch {batch_id}")
        trace = None if expected else exc
        if delay is None:
            log.error("batch %s: delivery to %s failed %d times, giving up: %s; "
                      "`atropos batches retry %s` re-queues it", batch_id,
                      self._target.name, attempts, error, batch_id, exc_info=trace)
        else:
            # The service failing is said once (app/outage.py); each attempt in one line.
            log.log(logging.INFO if expected else logging.WARNING,
                    "batch %s: delivery to %s failed (attempt %d of %d), retrying in "
                    "%.1f s: %s", batch_id, self._target.name, attempts,
                    policy.max_attempts, delay, error, exc_info=trace)


async def _captured(conn: AsyncConnection, trace_ids: list[str]) -> dict[str, dict[str, Any]]:
    """The token view of each of `trace_ids` (gateway trajectories) that has token ids:
    what the model saw and produced, for a target that trains on tokens."""
    if not trace_ids:
        return {}
    rows = await conn.execute(
        sa.select(PAYLOADS.c.trace_id, PAYLOADS.c.original)
        .where(PAYLOADS.c.trace_id.in_(trace_ids)))
    views = {}
    for trace_id, original in rows:
        try:
            views[trace_id] = token_view(trace_id, gateway_format.NAME, original)
        except HubError:  # no call came with ids
            continue
    return views


async def _in_thread(work: Callable[..., Any], *args: Any) -> Any:
    """`prepare` without ingest processes (`atropos worker`): off the event loop."""
    return await asyncio.to_thread(work, *args)
