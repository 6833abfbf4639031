"""OTLP/HTTP traces on the ingest path: which bodies are OTLP, and storing their spans.

A body is OTLP when its Content-Type is `application/x-protobuf` (an
ExportTraceServiceRequest), or when it is JSON whose top level has `resourceSpans`
(OTLP/JSON); anything else is left to the hub's own formats. Its spans are committed
before the answer (one transaction, in one hop: app/db/dialect.OneHop); a span resent
by an exporter retrying is stored once. Spans that cannot be used (no valid trace or
span id) are counted and reported, and the others stored: OTLP's partial success.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import orjson
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import LimitsConfig
from app.db.dialect import OneHop
from app.db.types import utcnow
from app.formats.otlp import wire
from app.ingest.ingestor import Ingestor
from app.ingest.otlp import store

log = logging.getLogger("atropos.otlp")

Encoding = Literal["protobuf", "json"]
PROTOBUF_TYPES = ("application/x-protobuf", "application/protobuf")
# How many reasons a partial success lists; the count covers them all.
_REASONS = 3


@dataclass(frozen=True, slots=True)
class ExportRequest:
    encoding: Encoding  # also the encoding of the answer
    request: ExportTraceServiceRequest
    unreadable: list[str]  # OTLP/JSON spans left out, and why


@dataclass(frozen=True, slots=True)
class Receipt:
    stored: int  # spans new to the hub
    resent: int  # spans it had already
    rejected: int
    message: str  # why, for partial_success.error_message; "" when nothing was rejected


def export_request(body: bytes, content_type: str) -> ExportRequest | None:
    """The OTLP request a body holds, or None when it is not OTLP. Raises BadRequest
    for a protobuf body that does not decode."""
    media = content_type.split(";")[0].strip().lower()
    if media in PROTOBUF_TYPES:
        return ExportRequest("protobuf", wire.from_protobuf(body), [])
    # A fast look before parsing: the hub's own JSON is parsed again elsewhere.
    if b'"resourceSpans"' not in body:
        return None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None  # the hub's JSON reader names the fault
    if not isinstance(doc, dict) or "resourceSpans" not in doc:
        return None
    request, unreadable = wire.from_json(doc)
    return ExportRequest("json", request, unreadable)


class SpanReceiver:
    def __init__(self, engine: AsyncEngine, ingestor: Ingestor, limits: LimitsConfig) -> None:
        self._hop = OneHop(engine)
        self._ingestor = ingestor
        self._limits = limits

    async def receive(self, export: ExportRequest) -> Receipt:
        """Store the request's usable spans; returns once they are committed."""
        records, rejected = wire.pieces(export.request)
        reasons = export.unreadable + rejected.reasons
        # An OTLP request takes a place on the write path per span, up to what one
        # request of traces may take: the same back-pressure (503) as other ingest.
        places = min(len(records), self._limits.max_traces_per_request)
        with self._ingestor.admit(places):
            now = utcnow()
            stored = await self._hop.run(lambda conn: store.add_spans(conn, records, now))
        if reasons:
            log.info("OTLP: %d spans rejected: %s", len(reasons), "; ".join(reasons[:_REASONS]))
        return Receipt(stored, len(records) - stored, len(reasons), _message(reasons))

    async def close(self) -> None:
        await self._hop.close()


def _message(reasons: list[str]) -> str:
    if not reasons:
        return ""
    more = f" (and {len(reasons) - _REASONS} more)" if len(reasons) > _REASONS else ""
    return f"{len(reasons)} spans rejected: " + "; ".join(reasons[:_REASONS]) + more
