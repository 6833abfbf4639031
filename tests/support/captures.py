"""The spans real agent frameworks sent, and what they sent the model
(/work/shared/reference/otel-captures: read in place, never copied), as OTLP/JSON for a
hub and as the ground truth a trajectory must match."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support import otlp

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
    """As the SDK's exporter encodes them: a list of strings is an arrayValue (where
    tests/support/otlp.py writes JSON, as instrumentations write messages)."""
    return [{"key": k, "value": _value(v)} for k, v in attrs.items()]


def _value(v: Any) -> dict[str, Any]:
    if isinstance(v, list):
        return {"arrayValue": {"values": [_value(x) for x in v]}}
    return otlp.value(v)


@dataclass
class Truth:
    """What a run really was, from what the framework sent the model and got back."""

    task: str
    model: str
    calls: list[tuple[str, Any, str]]  # (name, arguments, id), as the model made them
    texts: list[str]  # what the model said, in order
    results: dict[str, str]  # call id -> the result the model was sent (keyed APIs)
    seen: str  # every text the model was sent
    usage: tuple[int, int]
    last_text: str | None  # the model's last answer, when it was text
    last_calls: list[str]  # the calls of the model's last answer: no request shows a result


def truth(log: list[dict[str, Any]]) -> Truth:
    calls: list[tuple[str, Any, str]] = []
    texts: list[str] = []
    results: dict[str, str] = {}
    seen: list[str] = []
    used = [0, 0]
    users: list[str] = []
    last_text: str | None = None
    for entry in log:
        request, response = entry["request"], entry["response"]
        if entry["api"] == "responses":
            seen.append(str(request.get("instructions") or ""))
            for item in request["input"]:
                if item.get("type") == "function_call_output":
                    results[item["call_id"]] = item["output"]
                    seen.append(item["output"])
                elif item.get("role") == "user":
                    users.append(_text(item["content"]))
            said = response
            calls_now = [(i["name"], json.loads(i["arguments"]), i["call_id"])
                         for i in said if i["type"] == "function_call"]
            text = "".join(p["text"] for i in said if i["type"] == "message"
                           for p in i["content"] if p["type"] == "output_text") or None
            used[0] += entry["usage"]["input_tokens"]
            used[1] += entry["usage"]["output_tokens"]
        else:
            for message in request["messages"]:
                content = _text(message.get("content"))
                seen.append(content)
                if message["role"] == "tool":
                    results[message["tool_call_id"]] = content
                elif message["role"] == "user":
                    users.append(content)
            calls_now = [(c["function"]["name"], json.loads(c["function"]["arguments"]), c["id"])
                         for c in response.get("tool_calls") or []]
            text = response.get("content") or None
            used[0] += entry["usage"]["prompt_tokens"]
            used[1] += entry["usage"]["completion_tokens"]
        calls += calls_now
        if text:
            texts.append(text)
        last_text = text if not calls_now else None
    first = log[0]["request"]
    return Truth(task=users[0], model=first["model"], calls=calls, texts=texts,
                 results=results, seen="\n".join(seen), usage=(used[0], used[1]),
                 last_text=last_text, last_calls=[c[2] for c in calls_now])


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return content or ""
