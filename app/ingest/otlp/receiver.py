"""OTLP/HTTP traces on the ingest path: which bodies are OTLP, and storing their spans.

A body is OTLP when its Content-Type is `application/x-protobuf` (an
ExportTraceServiceRequest), or when it is JSON whose top level has `resourceSpans`
(OTLP/JSON); anything else is left to the hub's own formats. It is read in an ingest
process (app/ingest/otlp/request.py: decoded, its spans counted, their secrets
redacted), and its spans are committed before the answer (the group commit of spans,
app/db/group_commit.py); a span resent by an exporter retrying is stored once. Spans
that cannot be used (no valid trace or span id) are counted and reported, and the
others stored: OTLP's partial success.

The same limits as any ingest: limits.max_body_bytes (read_body), a place on the write
path per span up to what one request of traces may take (limits.max_queued_traces,
503), the writer's stalls and each request's wait for its commit bounded by
limits.max_write_wait_seconds (503), limits.max_item_seconds on the reading. And spans
are taken no faster than the assembly stage makes trajectories of them: while it is
more than otlp.max_assembly_lag_seconds behind, a request waits, then gets 503.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import LimitsConfig, OtlpConfig, PrivacyConfig
from app.db.dialect import OneHop
from app.db.group_commit import GroupCommit
from app.db.types import utcnow
from app.errors import Unavailable
from app.formats.otlp import wire
from app.ingest.admission import Admission
from app.ingest.body import NDJSON_TYPES
from app.ingest.otlp import store
from app.ingest.otlp.request import Encoding, read
from app.ingest.processes import IngestProcesses
from app.outage import Outage

log = logging.getLogger("atropos.otlp")

PROTOBUF_TYPES = ("application/x-protobuf", "application/protobuf")
# How many reasons a partial success lists; the count covers them all.
_REASONS = 3
# How often, at most, a receiver looks how far the assembly is behind.
_LOOK_EVERY_SECONDS = 0.1
# Spans per transaction at most (bounds its memory; requests are never split).
_MAX_SPANS_PER_COMMIT = 8192


@dataclass(frozen=True, slots=True)
class OtlpBody:
    """A request body that is OTLP, or JSON that may be (read() says), not yet read."""

    encoding: Encoding  # also the encoding of the answer
    payload: bytes


@dataclass(frozen=True, slots=True)
class Receipt:
    rejected: int  # spans left out
    message: str  # why, for partial_success.error_message; "" when nothing was rejected


def otlp_body(body: bytes, content_type: str) -> OtlpBody | None:
    """The body as OTLP, or None when it is surely not OTLP (the hub's own formats).
    JSON is OTLP when its top level has `resourceSpans`: what the ingest process that
    reads it finds out (a fast look here for the key anywhere)."""
    media = content_type.split(";")[0].strip().lower()
    if media in PROTOBUF_TYPES:
        return OtlpBody("protobuf", body)
    if media in NDJSON_TYPES or b'"resourceSpans"' not in body:
        return None
    return OtlpBody("json", body)


class _SpanKind:
    """Spans, for the group commit: each item is one request's usable spans."""

    name = "OTLP spans"

    def write(
        self, conn: sa.Connection, items: Sequence[list[wire.SpanRecord]]
    ) -> list[None]:
        store.add_spans(conn, [record for records in items for record in records], utcnow())
        return [None] * len(items)


class SpanReceiver:
    """The spans of the requests that queued while a transaction ran are written
    together in the next one, so that concurrent exporters share its fsync; each
    request is answered once it committed."""

    def __init__(
        self,
        engine: AsyncEngine,
        processes: IngestProcesses,
        admission: Admission | None,
        limits: LimitsConfig,
        config: OtlpConfig,
        privacy: PrivacyConfig,
        *,
        writer: OneHop,
        outage: Outage,
    ) -> None:
        """`processes`: where requests are read; `admission`: the HTTP API's, which
        then also counts this writer's stalls, and bounds each request's wait for its
        commit by limits.max_write_wait_seconds; `writer`, `outage`: the hub's."""
        self._engine = engine
        self._processes = processes
        self._admission = admission
        self._limits = limits
        self._config = config
        # Sent to the processes as its JSON, compiled there once (redactor_for).
        self._privacy = privacy.model_dump_json()
        self._oldest_due: datetime | None = None  # of the open traces, at the last look
        self._looked_at = -math.inf
        self.commits: GroupCommit[list[wire.SpanRecord], None] = GroupCommit(
            _SpanKind(), writer, outage,
            max_items=10_000, max_weight=_MAX_SPANS_PER_COMMIT, weight=len,
            max_wait=limits.max_write_wait_seconds if admission is not None else None,
            retry_after=limits.retry_after_seconds,
        )
        if admission is not None:
            admission.watch(self.write_wait)

    def start(self) -> None:
        self.commits.start()

    def write_wait(self) -> float:
        """How long the write in progress has run (0.0 when idle)."""
        return self.commits.write_wait()

    async def receive(self, body: OtlpBody) -> Receipt | None:
        """Store the request's usable spans; returns once they are committed. None for
        JSON that is not OTLP after all."""
        await self._keeping_up()
        with self._admit(1):  # a stalled writer or a full write path: 503 before any work
            decoded = await self._processes.call(
                read, body.payload, body.encoding, self._config.max_spans_per_request,
                self._privacy,
            )
        if decoded is None:
            return None
        records, reasons = decoded.records, decoded.rejected
        # A place on the write path per span, up to what one request of traces may
        # take: the same back-pressure (503) as other ingest.
        with self._admit(min(len(records), self._limits.max_traces_per_request)):
            if records:
                await self._store(records)
        if reasons:
            log.info("OTLP: %d spans rejected: %s", len(reasons), "; ".join(reasons[:_REASONS]))
        return Receipt(len(reasons), _message(reasons))

    async def _keeping_up(self) -> None:
        """Spans are taken only as fast as they become trajectories: while the assembly
        is more than otlp.max_assembly_lag_seconds behind, a request waits (up to
        limits.max_write_wait_seconds, as for its commit), then gets 503 (exporters
        retry), so that a trajectory still appears soon after its run ends and the
        backlog does not grow without end. Waiting rather than refusing at once keeps
        the exporters sending as soon as the assembly catches up, where a refusal idles
        them for a whole Retry-After."""
        most = self._config.max_assembly_lag_seconds
        give_up = time.monotonic() + self._limits.max_write_wait_seconds
        while (behind := await self.assembly_behind()) > most:
            if time.monotonic() >= give_up:
                raise Unavailable(
                    f"the assembly of trajectories is {behind:.1f} s behind (more than "
                    f"otlp.max_assembly_lag_seconds, {most:g} s); send these spans again "
                    "later",
                    retry_after=math.ceil(most),  # it catches up in about that long
                    code="overloaded",
                    field="otlp.max_assembly_lag_seconds",
                )
            await asyncio.sleep(_LOOK_EVERY_SECONDS)

    async def assembly_behind(self) -> float:
        """How long the trace due longest has waited for its assembly, in seconds. Read
        from the database, where every hub's receivers see the one backlog, whichever
        hubs assemble it; at most every _LOOK_EVERY_SECONDS (the requests meanwhile
        use the last look)."""
        if time.monotonic() - self._looked_at >= _LOOK_EVERY_SECONDS:
            self._looked_at = time.monotonic()
            try:
                async with self._engine.connect() as conn:
                    self._oldest_due = await store.oldest_due(
                        conn, utcnow(), self._config.quiet_seconds, self._config.max_wait_seconds
                    )
            except (SQLAlchemyError, OSError):
                pass  # the spans' write finds out, and answers for it
        if self._oldest_due is None:
            return 0.0
        return (utcnow() - self._oldest_due).total_seconds()

    def _admit(self, places: int) -> AbstractContextManager[None]:
        return self._admission.admit(places) if self._admission else nullcontext()

    async def _store(self, records: list[wire.SpanRecord]) -> None:
        # A client gone mid-write does not stop it.
        await asyncio.shield(self.commits.submit(records))

    async def close(self) -> None:
        """What was queued is committed (and answered) first."""
        await self.commits.stop()


def _message(reasons: list[str]) -> str:
    if not reasons:
        return ""
    more = f" (and {len(reasons) - _REASONS} more)" if len(reasons) > _REASONS else ""
    return f"{len(reasons)} spans rejected: " + "; ".join(reasons[:_REASONS]) + more
