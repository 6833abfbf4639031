"""The spans real agent frameworks sent, and what they sent the model
(/work/shared/reference/otel-captures: read in place, never copied), as OTLP/JSON for a
hub and as the ground truth a trajectory must match."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CAPTURES = Path("/work/shared/reference/otel-captures")
_STATUS = {"StatusCode.UNSET": 0, "StatusCode.OK": 1, "StatusCode.ERROR": 2}
_KIND = {"SpanKind.INTERNAL": 1, "SpanKind.SERVER": 2, "SpanKind.CLIENT": 3,
         "SpanKind.PRODUCER": 4, "SpanKind.CONSUMER": 5}


def spans(setup: str, scenario: str) -> list[dict[str, Any]]:
    loaded: list[dict[str, Any]] = json.loads((CAPTURES / setup / f"{scenario}.spans.json")
                                              .read_text())
    return loaded


def model_log(setup: str, scenario: str) -> list[dict[str, Any]]:
    loaded: list[dict[str, Any]] = json.loads(
        (CAPTURES / setup / f"{scenario}.model_log.json").read_text())
    return loaded


def document(captured: list[dict[str, Any]]) -> dict[str, Any]:
    """The captured spans as one OTLP/JSON request, grouped by resource and scope as the
    SDK's exporter groups them."""
    groups: dict[str, dict[str, list[dict[str, Any]]]] = {}
    resources: dict[str, dict[str, Any]] = {}
    scopes: dict[tuple[str, str], dict[str, Any]] = {}
    for s in captured:
        resource = json.dumps(s["resource"], sort_keys=True)
        resources[resource] = s["resource"]
        scope = f"{s['scope']}\0{s.get('scope_version') or ''}"
        scopes[(resource, scope)] = {"name": s["scope"], "version": s.get("scope_version") or ""}
        groups.setdefault(resource, {}).setdefault(scope, []).append(_span(s))
    return {"resourceSpans": [
        {"resource": {"attributes": attributes(resources[r])},
         "scopeSpans": [{"scope": scopes[(r, sc)], "spans": listed}
                        for sc, listed in by_scope.items()]}
        for r, by_scope in groups.items()]}


def _span(s: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "traceId": s["trace_id"], "spanId": s["span_id"], "name": s["name"],
        "kind": _KIND.get(s.get("kind", ""), 1),
        "startTimeUnixNano": str(s["start"]), "endTimeUnixNano": str(s["end"]),
        "attributes": attributes(s.get("attributes") or {}),
        "events": [{"name": e["name"],
                    # The captures keep no event times; an exception is raised as the
                    # span ends.
                    "timeUnixNano": str(s["end"]),
                    "attributes": attributes(e.get("attributes") or {})}
                   for e in s.get("events") or []],
    }
    if s.get("parent_span_id"):
        out["parentSpanId"] = s["parent_span_id"]
    status = s.get("status") or {}
    code = _STATUS.get(str(status.get("code")), 0)
    if code:
        out["status"] = {"code": code, **({"message": status["description"]}
                                          if status.get("description") else {})}
    return out


def attributes(attrs: dict[str, Any]) -> list[dict[str, Any]]:
    """As the SDK's exporter encodes them: a list of strings is an arrayValue."""
    return [{"key": k, "value": _value(v)} for k, v in attrs.items()]


def _value(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, list):
        return {"arrayValue": {"values": [_value(x) for x in v]}}
    return {"stringValue": str(v)}
