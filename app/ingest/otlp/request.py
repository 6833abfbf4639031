"""An OTLP request made into the span records the receiver stores, in an ingest process
(app/ingest/processes.py: off the event loop, under limits.max_item_seconds): decoded,
its spans counted against otlp.max_spans_per_request before any is read, and every
string the records hold redacted as the privacy section says, before they are stored.

Secrets are looked for as in any trace (app/evaluation/redaction.py): a pre-check over
the protobuf encoding (which holds strings as they are) of the body, or of each record,
and only on a hit are the records decoded and their strings rewritten: the span's name,
status message, attributes (keys and values), events and links, and the resource and
scope it came with. The counts go with the records (`SpanRecord.redactions`), for the
trajectory's `metadata.redactions`; those of a resource or scope with the first span
of its group in the request.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from app.errors import PayloadTooLarge
from app.evaluation.redaction import Redactor, redactor_for
from app.formats.otlp import wire

Encoding = Literal["protobuf", "json"]
# A string rewritten: (text, the attribute key it is the value of) -> text.
_Rewrite = Callable[[str, str | None], str]


@dataclass(frozen=True, slots=True)
class Decoded:
    records: list[wire.SpanRecord]  # the usable spans, redacted
    rejected: list[str]  # why each span left out was left out


def read(body: bytes, encoding: Encoding, max_spans: int, privacy: str) -> Decoded | None:
    """The records of an OTLP body (`privacy`: the privacy section's JSON); None for a
    JSON body that turns out not to be OTLP (no top-level `resourceSpans`): it is the
    hub's own JSON. Raises BadRequest for a body that does not decode, PayloadTooLarge
    past `max_spans` spans."""
    unreadable: list[str] = []
    if encoding == "protobuf":
        request = wire.from_protobuf(body)
        _count(request, max_spans)
    else:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None  # the hub's JSON reader names the fault
        if not isinstance(doc, dict) or "resourceSpans" not in doc:
            return None
        _count_json(doc, max_spans)
        request, unreadable = wire.from_json(doc)
    records, rejected = wire.pieces(request)
    redactor = redactor_for(privacy)
    # Protobuf holds every string as it is, so the whole body is looked at once; JSON
    # text may escape any character, so each record is, in protobuf.
    if records and (encoding == "json" or redactor.may_hold_secrets(body)):
        records = _redacted(records, redactor)
    # The reasons quote what was sent (a span's name, an id that does not decode): they
    # are logged, so their secrets go too.
    reasons = [redactor.redact_text(reason)[0] for reason in unreadable + rejected.reasons]
    return Decoded(records, reasons)


def _too_many(max_spans: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"more than {max_spans} spans in one request; otlp.max_spans_per_request is "
        f"{max_spans}: export smaller batches (OTEL_BSP_MAX_EXPORT_BATCH_SIZE)",
        field="otlp.max_spans_per_request",
    )


def _count(request: ExportTraceServiceRequest, max_spans: int) -> None:
    """Spans, and the groups that hold them, counted before any is read (len() of a
    repeated field makes no object per element)."""
    groups = spans = 0
    for rs in request.resource_spans:
        groups += 1 + len(rs.scope_spans)
        if groups > max_spans:
            raise _too_many(max_spans)
        for ss in rs.scope_spans:
            spans += len(ss.spans)
            if spans > max_spans:
                raise _too_many(max_spans)


def _count_json(doc: dict[str, Any], max_spans: int) -> None:
    groups = spans = 0
    for rs in _items(doc.get("resourceSpans")):
        scopes = _items(rs.get("scopeSpans", rs.get("scope_spans")) if isinstance(rs, dict)
                        else None)
        groups += 1 + len(scopes)
        if groups > max_spans:
            raise _too_many(max_spans)
        for ss in scopes:
            spans += len(_items(ss.get("spans") if isinstance(ss, dict) else None))
            if spans > max_spans:
                raise _too_many(max_spans)


def _items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []  # wire.from_json names a bad shape


# --- redaction ----------------------------------------------------------------------


def _redacted(records: list[wire.SpanRecord], redactor: Redactor) -> list[wire.SpanRecord]:
    groups: dict[bytes, bytes] = {}  # a resource or scope as received: redacted
    out: list[wire.SpanRecord] = []
    for record in records:
        counts: Counter[str] = Counter()
        resource = _group(record.resource, ResourceSpans, _resource_strings, redactor, groups,
                          counts)
        scope = _group(record.scope, ScopeSpans, _scope_strings, redactor, groups, counts)
        span = record.span
        if redactor.may_hold_secrets(span):
            span = _rewritten(span, Span, _span_strings, redactor, counts)
        out.append(dataclasses.replace(record, resource=resource, scope=scope, span=span,
                                       redactions=dict(counts) or None))
    return out


def _group(
    encoded: bytes,
    kind: type[Any],
    strings: Callable[[Any, _Rewrite], None],
    redactor: Redactor,
    done: dict[bytes, bytes],
    counts: Counter[str],
) -> bytes:
    """A resource or scope redacted, once per request: its counts go with the first
    span of the group."""
    if encoded not in done:
        done[encoded] = (
            _rewritten(encoded, kind, strings, redactor, counts)
            if redactor.may_hold_secrets(encoded) else encoded
        )
    return done[encoded]


def _rewritten(
    encoded: bytes,
    kind: type[Any],
    strings: Callable[[Any, _Rewrite], None],
    redactor: Redactor,
    counts: Counter[str],
) -> bytes:
    """The message with its secrets replaced, counted into `counts`."""
    found: Counter[str] = Counter()
    message = kind()
    message.ParseFromString(encoded)
    strings(message, lambda text, key: redactor.rewrite(text, found, key))
    if not found:
        return encoded  # a mark without a secret: stored as it came
    counts.update(found)
    return bytes(message.SerializeToString())


def _span_strings(span: Span, rewrite: _Rewrite) -> None:
    span.name = rewrite(span.name, None)
    if span.status.message:
        span.status.message = rewrite(span.status.message, None)
    _attributes(span.attributes, rewrite)
    for event in span.events:
        event.name = rewrite(event.name, None)
        _attributes(event.attributes, rewrite)
    for link in span.links:
        _attributes(link.attributes, rewrite)


def _resource_strings(group: ResourceSpans, rewrite: _Rewrite) -> None:
    _attributes(group.resource.attributes, rewrite)


def _scope_strings(group: ScopeSpans, rewrite: _Rewrite) -> None:
    scope = group.scope
    scope.name = rewrite(scope.name, None)
    scope.version = rewrite(scope.version, None)
    _attributes(scope.attributes, rewrite)


def _attributes(pairs: Iterable[KeyValue], rewrite: _Rewrite) -> None:
    for pair in pairs:
        key = pair.key
        pair.key = rewrite(key, None)
        _value(pair.value, key, rewrite)


def _value(value: AnyValue, key: str | None, rewrite: _Rewrite) -> None:
    kind = value.WhichOneof("value")
    if kind == "string_value":
        value.string_value = rewrite(value.string_value, key)
    elif kind == "array_value":
        for item in value.array_value.values:
            _value(item, None, rewrite)
    elif kind == "kvlist_value":
        _attributes(value.kvlist_value.values, rewrite)
