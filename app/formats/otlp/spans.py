"""An OTLP/JSON document read into plain spans: ids in hex, times in nanoseconds,
attributes as Python values (`{"intValue": "3"}` is 3, a kvlist is a dict). Errors
are `Invalid` naming the JSON path."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from app.formats import _common as c
from app.formats.otlp.wire import SPAN_ID_BYTES, TRACE_ID_BYTES, id_bytes

STATUS_ERROR = 2
_STATUS_NAMES = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}
_REMOTE_PARENT = 0x200


@dataclass(slots=True)
class Event:
    name: str
    time: int
    attrs: dict[str, Any]


@dataclass(slots=True)
class Span:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    start: int
    end: int
    attrs: dict[str, Any]
    events: list[Event]
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    resource: dict[str, Any] = field(default_factory=dict)
    remote_parent: bool = False

    @property
    def root(self) -> bool:
        return self.parent_id is None or self.remote_parent

    @property
    def failed(self) -> bool:
        return self.status_code == STATUS_ERROR


def failure(span: Span) -> str | None:
    """Why a failed span failed, in the words it carries: the message of the exception
    it recorded (a status message may hold the whole traceback), else its status
    message, else its `error.type`."""
    if not span.failed:
        return None
    for event in reversed(span.events):
        message = event.attrs.get("exception.message") if event.name == "exception" else None
        if isinstance(message, str) and message:
            return message
    if span.status_message:
        return span.status_message
    error_type = span.attrs.get("error.type")
    return str(error_type) if error_type else "the tool failed"


def read(doc: dict[str, Any]) -> list[Span]:
    """Every span of the document, in start order (then span id, for a stable order)."""
    spans: list[Span] = []
    for i, rs in enumerate(c.req_list(doc, "resourceSpans")):
        where = f"resourceSpans[{i}]"
        rs = c.as_dict(rs, where)
        resource = c.opt_dict(rs, "resource", where) or {}
        resource_attrs = attributes(
            resource.get("attributes"), c.path(where, "resource.attributes")
        )
        for j, ss in enumerate(c.opt_list(rs, "scopeSpans", where) or []):
            ss_where = c.path(c.path(where, "scopeSpans"), j)
            ss = c.as_dict(ss, ss_where)
            for k, raw in enumerate(c.opt_list(ss, "spans", ss_where) or []):
                span = _span(raw, c.path(c.path(ss_where, "spans"), k))
                span.resource = resource_attrs
                spans.append(span)
    spans.sort(key=lambda s: (s.start, s.span_id))
    return spans


def attributes(raw: Any, where: str) -> dict[str, Any]:
    """OTLP key-value pairs (the list at `where`) as a dict; a key sent twice keeps its
    last value."""
    if raw is None:
        return {}
    if not isinstance(raw, list):
        c.fail(where, f"expected an array of key-value pairs, got {c.type_name(raw)}")
    out: dict[str, Any] = {}
    for i, pair in enumerate(raw):
        # The common case first; the paths of errors are written only for errors.
        if isinstance(pair, dict) and isinstance(key := pair.get("key"), str):
            given = pair.get("value")
            if isinstance(given, dict) and len(given) == 1 and "stringValue" in given:
                out[key] = given["stringValue"]
            else:
                out[key] = value(given, c.path(where, i))
        else:
            pair_where = c.path(where, i)
            c.req_str(c.as_dict(pair, pair_where), "key", pair_where)
    return out


def value(raw: Any, where: str) -> Any:
    """An OTLP AnyValue as a Python value."""
    if raw is None:
        return None
    obj = c.as_dict(raw, c.path(where, "value"))
    if "stringValue" in obj:
        return obj["stringValue"]
    if "boolValue" in obj:
        return bool(obj["boolValue"])
    if "intValue" in obj:
        return _integer(obj["intValue"], c.path(where, "value.intValue"))
    if "doubleValue" in obj:
        return _double(obj["doubleValue"])
    if "arrayValue" in obj:
        values = c.opt_list(obj["arrayValue"] or {}, "values", c.path(where, "value.arrayValue"))
        return [value(v, c.path(where, f"value.arrayValue.values[{i}]"))
                for i, v in enumerate(values or [])]
    if "kvlistValue" in obj:
        kvlist = obj["kvlistValue"] or {}
        return attributes(kvlist.get("values"), c.path(where, "value.kvlistValue.values"))
    if "bytesValue" in obj:
        return obj["bytesValue"]
    return None


def _span(raw: Any, where: str) -> Span:
    obj = c.as_dict(raw, where)
    parent = obj.get("parentSpanId") or None
    status = c.opt_dict(obj, "status", where) or {}
    code = status.get("code", 0)
    if isinstance(code, str):
        code = _STATUS_NAMES.get(code, 0)
    flags = obj.get("flags")
    return Span(
        trace_id=_id(obj.get("traceId"), TRACE_ID_BYTES, c.path(where, "traceId")),
        span_id=_id(obj.get("spanId"), SPAN_ID_BYTES, c.path(where, "spanId")),
        parent_id=None if parent is None else _id(parent, SPAN_ID_BYTES,
                                                  c.path(where, "parentSpanId")),
        name=c.opt_str(obj, "name", where) or "",
        start=_integer(obj.get("startTimeUnixNano", 0), c.path(where, "startTimeUnixNano")),
        end=_integer(obj.get("endTimeUnixNano", 0), c.path(where, "endTimeUnixNano")),
        attrs=attributes(obj.get("attributes"), c.path(where, "attributes")),
        events=[_event(e, c.path(c.path(where, "events"), i))
                for i, e in enumerate(c.opt_list(obj, "events", where) or [])],
        status_code=code if isinstance(code, int) else 0,
        status_message=c.opt_str(status, "message", c.path(where, "status")) or "",
        remote_parent=isinstance(flags, int) and bool(flags & _REMOTE_PARENT),
    )


def _event(raw: Any, where: str) -> Event:
    obj = c.as_dict(raw, where)
    return Event(
        name=c.opt_str(obj, "name", where) or "",
        time=_integer(obj.get("timeUnixNano", 0), c.path(where, "timeUnixNano")),
        attrs=attributes(obj.get("attributes"), c.path(where, "attributes")),
    )


def _id(raw: Any, size: int, where: str) -> str:
    try:
        return id_bytes(raw, size).hex()
    except ValueError as exc:
        c.fail(where, str(exc))


def _integer(raw: Any, where: str) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, str):
        try:
            return int(raw)
        except ValueError:
            pass
    c.fail(where, f"expected an integer, got {c.type_name(raw)}")


def _double(raw: Any) -> float | None:
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return float(raw)
    if isinstance(raw, str):
        try:
            number = float(raw)
        except ValueError:
            return None
        return number if math.isfinite(number) else None
    return None
