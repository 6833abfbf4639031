"""OTLP/HTTP traces on the ingest path: which bodies are OTLP, and storing their spans.

A body is OTLP when its Content-Type is `application/x-protobuf` (an
ExportTraceServiceRequest), or when it is JSON whose top level has `resourceSpans`
(OTLP/JSON); anything else is left to the hub's own formats. Its spans are committed
before the answer (one transaction, in one hop: app/db/dialect.OneHop); a span resent
by an exporter retrying is stored once. Spans that cannot be used (no valid trace or
span id) are counted and reported, and the others stored: OTLP's partial success.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import orjson
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import LimitsConfig
from app.db.dialect import OneHop
from app.db.types import utcnow
from app.errors import Unavailable
from app.formats.otlp import wire
from app.ingest.admission import Admission
from app.ingest.otlp import store

log = logging.getLogger("atropos.otlp")

Encoding = Literal["protobuf", "json"]
PROTOBUF_TYPES = ("application/x-protobuf", "application/protobuf")
# How many reasons a partial success lists; the count covers them all.
_REASONS = 3
# Spans per transaction at most (bounds its memory; requests are never split).
_MAX_SPANS_PER_COMMIT = 8192


@dataclass(frozen=True, slots=True)
class OtlpBody:
    """A request body found to be OTLP, not yet decoded."""

    encoding: Encoding  # also the encoding of the answer
    payload: bytes | dict[str, Any]  # protobuf bytes, or the decoded OTLP/JSON document


@dataclass(frozen=True, slots=True)
class Receipt:
    rejected: int  # spans left out
    message: str  # why, for partial_success.error_message; "" when nothing was rejected


def otlp_body(body: bytes, content_type: str) -> OtlpBody | None:
    """The body as OTLP, or None when it is not OTLP (then it is the hub's own JSON)."""
    media = content_type.split(";")[0].strip().lower()
    if media in PROTOBUF_TYPES:
        return OtlpBody("protobuf", body)
    # A fast look before parsing: the hub's own JSON is parsed again elsewhere.
    if b'"resourceSpans"' not in body:
        return None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None  # the hub's JSON reader names the fault
    if not isinstance(doc, dict) or "resourceSpans" not in doc:
        return None
    return OtlpBody("json", doc)


def _decoded(body: OtlpBody) -> tuple[ExportTraceServiceRequest, list[str]]:
    """The request, and the OTLP/JSON spans left out and why. Raises BadRequest for a
    body that does not decode."""
    if isinstance(body.payload, bytes):
        return wire.from_protobuf(body.payload), []
    return wire.from_json(body.payload)


@dataclass(slots=True)
class _Waiting:
    records: list[wire.SpanRecord]
    done: asyncio.Future[None]
    since: float  # time.monotonic() when it was queued


class SpanReceiver:
    """Group commit, as for traces (app/ingest/inserter.py): the spans of the requests
    that queued while a transaction ran are written together in the next one, so that
    concurrent exporters share its fsync; each request is answered once it committed."""

    def __init__(
        self, engine: AsyncEngine, admission: Admission | None, limits: LimitsConfig
    ) -> None:
        """`admission`: the HTTP API's, which then also counts this writer's stalls."""
        self._hop = OneHop(engine)
        self._admission = admission
        self._limits = limits
        self._queue: deque[_Waiting] = deque()
        self._writer: asyncio.Task[None] | None = None
        if admission is not None:
            admission.watch(self.write_wait)

    def write_wait(self) -> float:
        """How long the oldest request not yet committed has waited (0.0 when none)."""
        return time.monotonic() - self._queue[0].since if self._queue else 0.0

    async def receive(self, body: OtlpBody) -> Receipt:
        """Store the request's usable spans; returns once they are committed."""
        request, unreadable = _decoded(body)
        records, rejected = wire.pieces(request)
        reasons = unreadable + rejected.reasons
        # An OTLP request takes a place on the write path per span, up to what one
        # request of traces may take: the same back-pressure (503) as other ingest.
        places = min(len(records), self._limits.max_traces_per_request)
        with self._admission.admit(places) if self._admission else nullcontext():
            if records:
                await self._store(records)
        if reasons:
            log.info("OTLP: %d spans rejected: %s", len(reasons), "; ".join(reasons[:_REASONS]))
        return Receipt(len(reasons), _message(reasons))

    async def _store(self, records: list[wire.SpanRecord]) -> None:
        waiting = _Waiting(records, asyncio.get_running_loop().create_future(), time.monotonic())
        self._queue.append(waiting)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write(), name="otlp-span-writer")
        await asyncio.shield(waiting.done)  # a client gone mid-write does not stop it

    async def _write(self) -> None:
        while self._queue:
            batch: list[_Waiting] = []
            spans = 0
            while self._queue and (not batch or spans < _MAX_SPANS_PER_COMMIT):
                batch.append(self._queue[0])
                spans += len(self._queue[0].records)
                self._queue.popleft()
            records = [record for waiting in batch for record in waiting.records]
            try:
                await self._hop.run(partial(store.add_spans, records=records, now=utcnow()))
            except Exception as exc:  # the batch failed as a whole: nobody was acknowledged
                log.error("storing %d spans failed: %s", len(records), exc)
                failure = Unavailable("the database did not accept the spans; retry",
                                      retry_after=self._limits.retry_after_seconds)
                for waiting in batch:
                    waiting.done.set_exception(failure)
            else:
                for waiting in batch:
                    waiting.done.set_result(None)

    async def close(self) -> None:
        if self._writer is not None:
            await self._writer  # what was queued is committed (and answered) first
        await self._hop.close()


def _message(reasons: list[str]) -> str:
    if not reasons:
        return ""
    more = f" (and {len(reasons) - _REASONS} more)" if len(reasons) > _REASONS else ""
    return f"{len(reasons)} spans rejected: " + "; ".join(reasons[:_REASONS]) + more
