"""OTLP's two encodings of an `ExportTraceServiceRequest`, read with the official
`opentelemetry-proto` messages.

- `from_protobuf(body)`: `application/x-protobuf`.
- `from_json(doc)`: OTLP/JSON. As the specification says, trace and span ids are hex
  (not proto3 JSON's base64), enums may be integers or names and 64-bit integers
  numbers or strings; ids in base64, which some exporters send, are read too. A span
  that cannot be read is left out and reported, never the whole request.
- `to_json(request)`: OTLP/JSON as the specification writes it (hex ids, 64-bit
  integers as strings, enums as integers), for the stored original of a trajectory.
- `status(code, message)`: the google.rpc.Status an OTLP/HTTP error answers with.
- `pieces(request)` / `join(groups)`: a request split into one stored record per span
  (with the resource and scope it came in), and records joined back into a request, by
  concatenating their encodings: nothing is decoded on the serving process's loop.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, SpanFlags

from app.errors import BadRequest

TRACE_ID_BYTES = 16
SPAN_ID_BYTES = 8
# The parent is in another process: this span is the root of the part we see.
_REMOTE_PARENT = SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
# Field numbers, for joining encoded records without decoding them.
_REQUEST_RESOURCE_SPANS = 1
_RESOURCE_SPANS_SCOPE_SPANS = 2
_SCOPE_SPANS_SPANS = 2


@dataclass(frozen=True, slots=True)
class SpanRecord:
    """One span, as stored until its trace is assembled."""

    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    start_ns: int
    root: bool  # no parent here: the run's own root span (spans arrive once ended)
    resource: bytes  # the ResourceSpans without its scope_spans
    scope: bytes  # the ScopeSpans without its spans
    span: bytes
    # Secrets replaced in these, by kind (app/ingest/otlp/request.py); None: none.
    redactions: dict[str, int] | None = None


@dataclass(frozen=True, slots=True)
class Rejected:
    count: int
    reasons: list[str]  # the first few, for partial_success.error_message


def from_protobuf(body: bytes) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        raise BadRequest(
            f"the body is not an OTLP ExportTraceServiceRequest in protobuf: {exc}",
            code="malformed_protobuf",
        ) from None
    return request


def from_json(doc: dict[str, Any]) -> tuple[ExportTraceServiceRequest, list[str]]:
    """The request an OTLP/JSON body holds, and why each span left out was left out.
    A body whose structure is wrong (resourceSpans not a list) is a BadRequest."""
    request = ExportTraceServiceRequest()
    problems: list[str] = []
    for i, rs_doc in enumerate(_list(doc, "resourceSpans", "")):
        where = f"resourceSpans[{i}]"
        rs = request.resource_spans.add()
        _parse_into(rs, _object(rs_doc, where), where, skip=("scopeSpans", "scope_spans"))
        for j, ss_doc in enumerate(_list(rs_doc, "scopeSpans", where, "scope_spans")):
            ss_where = f"{where}.scopeSpans[{j}]"
            ss = rs.scope_spans.add()
            _parse_into(ss, _object(ss_doc, ss_where), ss_where, skip=("spans",))
            for k, span_doc in enumerate(_list(ss_doc, "spans", ss_where)):
                span_where = f"{ss_where}.spans[{k}]"
                try:
                    ss.spans.append(_span(span_doc, span_where))
                except ValueError as exc:
                    problems.append(f"{span_where}: {exc}")
    return request, problems


def pieces(request: ExportTraceServiceRequest) -> tuple[list[SpanRecord], Rejected]:
    """Each usable span as a record; the others counted, with the reasons."""
    records: list[SpanRecord] = []
    reasons: list[str] = []
    rejected = 0
    for i, rs in enumerate(request.resource_spans):
        resource = ResourceSpans(resource=rs.resource, schema_url=rs.schema_url)
        resource_bytes = resource.SerializeToString()
        for j, ss in enumerate(rs.scope_spans):
            scope_bytes = ScopeSpans(scope=ss.scope, schema_url=ss.schema_url).SerializeToString()
            for span in ss.spans:
                problem = _unusable(span)
                if problem is not None:
                    rejected += 1
                    # Named, not numbered: OTLP/JSON spans that did not decode are gone.
                    reasons.append(
                        f"resourceSpans[{i}].scopeSpans[{j}]: span {span.name[:80]!r}: {problem}"
                    )
                    continue
                parent = span.parent_span_id
                records.append(
                    SpanRecord(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        start_ns=span.start_time_unix_nano,
                        root=not parent or bool(span.flags & _REMOTE_PARENT),
                        resource=resource_bytes,
                        scope=scope_bytes,
                        span=span.SerializeToString(),
                    )
                )
    return records, Rejected(rejected, reasons)


def join(groups: Iterable[tuple[bytes, bytes, list[bytes]]]) -> bytes:
    """An ExportTraceServiceRequest from (resource, scope, spans) records, by
    concatenation: a message's encoding is its fields' encodings, in any order."""
    by_resource: dict[bytes, list[bytes]] = {}
    for resource, scope, spans in groups:
        body = scope + b"".join(_field(_SCOPE_SPANS_SPANS, span) for span in spans)
        by_resource.setdefault(resource, []).append(_field(_RESOURCE_SPANS_SCOPE_SPANS, body))
    return b"".join(
        _field(_REQUEST_RESOURCE_SPANS, resource + b"".join(scopes))
        for resource, scopes in by_resource.items()
    )


def to_json(request: ExportTraceServiceRequest) -> dict[str, Any]:
    return {
        "resourceSpans": [
            {
                **_message_json(rs, skip="scope_spans"),
                "scopeSpans": [
                    {**_message_json(ss, skip="spans"), "spans": [_span_json(s) for s in ss.spans]}
                    for ss in rs.scope_spans
                ],
            }
            for rs in request.resource_spans
        ]
    }


def id_bytes(value: Any, size: int) -> bytes:
    """A trace id (16 bytes) or span id (8) from OTLP/JSON: hex, as the specification
    says, or base64, as some exporters send; ValueError when it is neither."""
    if not isinstance(value, str):
        raise ValueError(f"expected a string of {2 * size} hex digits")
    if len(value) == 2 * size:
        try:
            return bytes.fromhex(value)
        except ValueError:
            pass
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) == size:
        return raw
    raise ValueError(f"{value[:40]!r} is neither {2 * size} hex digits nor base64 of {size} bytes")


# --- reading OTLP/JSON --------------------------------------------------------------


def _span(doc: Any, where: str) -> Span:
    if not isinstance(doc, dict):
        raise ValueError("a span must be a JSON object")
    ids = {key: doc.get(key) for key in ("traceId", "spanId", "parentSpanId")}
    rest = {k: v for k, v in doc.items() if k not in ids and k != "links"}
    span = Span()
    _parse_into(span, rest, where)
    span.trace_id = id_bytes(ids["traceId"], TRACE_ID_BYTES) if ids["traceId"] else b""
    span.span_id = id_bytes(ids["spanId"], SPAN_ID_BYTES) if ids["spanId"] else b""
    if ids["parentSpanId"]:
        span.parent_span_id = id_bytes(ids["parentSpanId"], SPAN_ID_BYTES)
    for i, link_doc in enumerate(doc.get("links") or []):
        if not isinstance(link_doc, dict):
            raise ValueError(f"links[{i}] must be a JSON object")
        link = span.links.add()
        _parse_into(link, {k: v for k, v in link_doc.items() if k not in ("traceId", "spanId")},
                    where)
        link.trace_id = id_bytes(link_doc.get("traceId"), TRACE_ID_BYTES)
        link.span_id = id_bytes(link_doc.get("spanId"), SPAN_ID_BYTES)
    return span


def _parse_into(message: Any, doc: dict[str, Any], where: str, skip: tuple[str, ...] = ()) -> None:
    fields = {k: v for k, v in doc.items() if k not in skip}
    try:
        json_format.ParseDict(fields, message, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
        raise ValueError(str(exc)[:300]) from None


def _object(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    raise BadRequest(f"{where} must be a JSON object", field=where)


def _list(doc: Any, key: str, where: str, alias: str | None = None) -> list[Any]:
    value = doc.get(key, doc.get(alias) if alias else None)
    if value is None:
        return []
    if isinstance(value, list):
        return value
    field = f"{where}.{key}" if where else key
    raise BadRequest(f"{field} must be a list", field=field)


def _unusable(span: Span) -> str | None:
    if len(span.trace_id) != TRACE_ID_BYTES or not any(span.trace_id):
        return f"traceId must be {TRACE_ID_BYTES} bytes, not all zero"
    if len(span.span_id) != SPAN_ID_BYTES or not any(span.span_id):
        return f"spanId must be {SPAN_ID_BYTES} bytes, not all zero"
    if span.parent_span_id and len(span.parent_span_id) != SPAN_ID_BYTES:
        return f"parentSpanId must be empty or {SPAN_ID_BYTES} bytes"
    return None


# --- writing OTLP/JSON --------------------------------------------------------------
# By hand rather than json_format.MessageToDict: ids in hex, and much faster (a
# trajectory of a few hundred spans is decoded on every assembly: docs/otlp.md).


def _message_json(message: Any, skip: str) -> dict[str, Any]:
    """A ResourceSpans or ScopeSpans but its children. Their resource and scope hold no
    ids, so proto3 JSON is OTLP/JSON there; they are decoded once per group of spans."""
    out: dict[str, Any] = {}
    for field, value in message.ListFields():
        if field.name != skip:
            out[field.json_name] = (
                value if isinstance(value, str) else json_format.MessageToDict(value)
            )
    return out


def _span_json(span: Span) -> dict[str, Any]:
    out: dict[str, Any] = {"traceId": span.trace_id.hex(), "spanId": span.span_id.hex()}
    if span.trace_state:
        out["traceState"] = span.trace_state
    if span.parent_span_id:
        out["parentSpanId"] = span.parent_span_id.hex()
    if span.flags:
        out["flags"] = span.flags
    out["name"] = span.name
    out["kind"] = span.kind
    out["startTimeUnixNano"] = str(span.start_time_unix_nano)
    out["endTimeUnixNano"] = str(span.end_time_unix_nano)
    if span.attributes:
        out["attributes"] = _attributes(span.attributes)
    if span.dropped_attributes_count:
        out["droppedAttributesCount"] = span.dropped_attributes_count
    if span.events:
        out["events"] = [_event_json(event) for event in span.events]
    if span.dropped_events_count:
        out["droppedEventsCount"] = span.dropped_events_count
    if span.links:
        out["links"] = [_link_json(link) for link in span.links]
    if span.dropped_links_count:
        out["droppedLinksCount"] = span.dropped_links_count
    if span.status.code or span.status.message:
        status: dict[str, Any] = {"code": span.status.code}
        if span.status.message:
            status["message"] = span.status.message
        out["status"] = status
    return out


def _event_json(event: Span.Event) -> dict[str, Any]:
    out: dict[str, Any] = {"timeUnixNano": str(event.time_unix_nano), "name": event.name}
    if event.attributes:
        out["attributes"] = _attributes(event.attributes)
    if event.dropped_attributes_count:
        out["droppedAttributesCount"] = event.dropped_attributes_count
    return out


def _link_json(link: Span.Link) -> dict[str, Any]:
    out: dict[str, Any] = {"traceId": link.trace_id.hex(), "spanId": link.span_id.hex()}
    if link.trace_state:
        out["traceState"] = link.trace_state
    if link.attributes:
        out["attributes"] = _attributes(link.attributes)
    if link.flags:
        out["flags"] = link.flags
    return out


def _attributes(pairs: Iterable[KeyValue]) -> list[dict[str, Any]]:
    return [{"key": kv.key, "value": _value(kv.value)} for kv in pairs]


def _value(value: AnyValue) -> dict[str, Any]:
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return {"stringValue": value.string_value}
    if kind == "int_value":
        return {"intValue": str(value.int_value)}
    if kind == "bool_value":
        return {"boolValue": value.bool_value}
    if kind == "double_value":
        return {"doubleValue": _double(value.double_value)}
    if kind == "array_value":
        return {"arrayValue": {"values": [_value(v) for v in value.array_value.values]}}
    if kind == "kvlist_value":
        return {"kvlistValue": {"values": _attributes(value.kvlist_value.values)}}
    if kind == "bytes_value":
        return {"bytesValue": base64.b64encode(value.bytes_value).decode()}
    return {}


def _double(number: float) -> float | str:
    # proto3 JSON: the non-finite doubles as strings (JSON has no literal for them).
    if number != number:
        return "NaN"
    if number in (float("inf"), float("-inf")):
        return "Infinity" if number > 0 else "-Infinity"
    return number


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the payload's length, the payload."""
    return bytes(_varint(number << 3 | 2)) + bytes(_varint(len(payload))) + payload


def _varint(value: int) -> Iterator[int]:
    while value > 0x7F:
        yield value & 0x7F | 0x80
        value >>= 7
    yield value


def status(code: int, message: str) -> bytes:
    """A google.rpc.Status (code = 1, message = 2): the body OTLP/HTTP gives a failed
    request. Encoded by hand; the message type is not in opentelemetry-proto."""
    code_field = bytes([1 << 3, *_varint(code)]) if code else b""  # 0 is not written
    return code_field + _field(2, message.encode())
