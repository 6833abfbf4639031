"""The per-request and per-trace limits: each refusal names its limit, nothing refused
is stored, and the good items of a batch still are."""

from __future__ import annotations

import gzip
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.config import LimitsConfig
from app.errors import Invalid, PayloadTooLarge
from app.ingest.limits import check_item, json_depth
from tests.support.builders import native_trace
from tests.support.waiting import wait_until

LIMITS = {"max_traces_per_request": 3, "max_steps_per_trace": 6, "max_step_chars": 300,
          "max_json_depth": 8, "max_queued_traces": 50}


def nested(levels: int) -> Any:
    value: Any = "leaf"
    for _ in range(levels):
        value = {"k": value}
    return value


def steps(n: int) -> list[dict[str, Any]]:
    return [{"type": "thought", "content": f"thinking, round {i}"} for i in range(n)]


def hermes(turns: list[tuple[str, str]]) -> dict[str, Any]:
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


# (a trace over one limit, the status, the limit named in `field`)
OVER = [
    (native_trace(steps=steps(7)), 413, "max_steps_per_trace"),
    ({"messages": [{"role": "user", "content": "hi"}] * 7}, 413, "max_steps_per_trace"),
    # Two turns as sent, but eight steps once normalised (thoughts and tool calls).
    (hermes([("human", "go"), ("gpt", "<think>a</think><think>b</think>" + "".join(
        f'<tool_call>{{"name": "t{i}", "arguments": {{}}}}</tool_call>' for i in range(6)))]),
     413, "max_steps_per_trace"),
    (native_trace(steps=[{"type": "thought", "content": "x" * 301}]), 413, "max_step_chars"),
    (native_trace(steps=[{"type": "action", "tool": "t", "call_id": "c",
                          "arguments": {"text": "y" * 300}}]), 413, "max_step_chars"),
    ({"messages": [{"role": "user", "content": "z" * 400}]}, 413, "max_step_chars"),
    (native_trace(metadata=nested(8)), 422, "max_json_depth"),
    (native_trace(steps=[{"type": "action", "tool": "t", "call_id": "c",
                          "arguments": nested(7)}]), 422, "max_json_depth"),
]


@pytest.fixture
def limited(start_hub: Any, trace_server: dict[str, Any]) -> Iterator[httpx.Client]:
    hub = start_hub(trace_server, limits=LIMITS)
    with hub.client() as client:
        yield client


def test_each_limit_is_named(limited: httpx.Client) -> None:
    for trace, status, limit in OVER:
        r = limited.post("/v1/traces", json=trace)
        assert r.status_code == status, (limit, r.text)
        error = r.json()["error"]
        assert error["field"] == f"limits.{limit}"
        assert f"limits.{limit}" in error["message"]
    # The same traces in one batch: each answered on its own, the good one stored.
    r = limited.post("/v1/traces", json={"traces": [OVER[0][0], native_trace(trace_id="ok"),
                                                    OVER[-1][0]]})
    assert r.status_code == 207
    results = r.json()["results"]
    assert results[0]["error"]["field"] == "limits.max_steps_per_trace"
    assert results[1]["trace_id"] == "ok"
    assert results[2]["error"]["field"] == "limits.max_json_depth"
    assert limited.get("/v1/stats").json()["traces"] == 1
    # Just under every limit is fine.
    at_limits = native_trace(steps=[*steps(5), {"type": "final", "content": "w" * 300}],
                             metadata=nested(6))
    assert limited.post("/v1/traces", json=at_limits).status_code == 202


def test_traces_per_request(limited: httpx.Client) -> None:
    r = limited.post("/v1/traces", json=[native_trace()] * 4)
    assert r.status_code == 413
    assert r.json()["error"]["field"] == "limits.max_traces_per_request"
    ndjson = "\n".join([httpx.Response(200, json=native_trace()).text] * 4)
    r = limited.post("/v1/traces", content=ndjson,
                     headers={"content-type": "application/x-ndjson"})
    assert r.status_code == 413
    assert limited.get("/v1/stats").json()["traces"] == 0
    assert limited.post("/v1/traces", json=[native_trace()] * 3).status_code == 207


def _kb(pid: int, field: str) -> int:
    """A /proc/PID/status figure, in kB: VmRSS now, VmHWM the peak so far."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


@pytest.mark.process
def test_item_count_bombs_are_refused_before_anything_is_built(
    start_hub_process: Any, tmp_path: Path
) -> None:
    """A million `{}` is 3 MB of JSON and 5 KB of gzip; parsed, ~100 MB; validated by
    pydantic, an error each, 3.4 GB. Each is refused after counting."""
    hub = start_hub_process({"storage_backend": "sqlite", "db_path": str(tmp_path / "t.db")})
    assert hub.proc is not None
    empties = [b"{}"] * 1_000_000
    bombs = [
        ("/v1/traces", b"\n".join(empties), "application/x-ndjson",
         "limits.max_traces_per_request"),
        ("/v1/traces", b"[" + b",".join(empties) + b"]", "application/json",
         "limits.max_traces_per_request"),
        ("/v1/traces", b'{"traces": [' + b",".join(empties) + b"]}", "application/json",
         "limits.max_traces_per_request"),
        ("/scored_data_list", b"[" + b",".join(empties) + b"]", "application/json",
         "atropos.max_groups_per_request"),
    ]
    with hub.client() as client:
        # The hub answers before it loads its tokenizer and starts its ingest processes:
        # measured from once it has, the memory below is what the requests took.
        wait_until(lambda: any("pipeline ready" in line for line in hub.lines),
                   what="the hub's background started")
        before = _kb(hub.proc.pid, "VmRSS")
        for path, body, media, limit in bombs:
            r = client.post(path, content=gzip.compress(body),
                            headers={"content-type": media, "content-encoding": "gzip"})
            assert r.status_code == 413, (path, r.text)
            assert r.json()["error"]["field"] == limit
        # Under the count, a list of bad groups: the first 20 errors, not 30,000.
        ten_thousand = b"[" + b",".join([b"{}"] * 10_000) + b"]"
        r = client.post("/scored_data_list", content=gzip.compress(ten_thousand),
                        headers={"content-type": "application/json",
                                 "content-encoding": "gzip"})
        assert r.status_code == 422 and r.json()["error"]["field"] == "0.tokens"
        assert r.json()["error"]["message"].endswith("(and 19 more)")
        peak, after = _kb(hub.proc.pid, "VmHWM"), _kb(hub.proc.pid, "VmRSS")
        assert peak - before < 120_000, f"peak {peak} kB, {before} kB before"
        assert after - before < 60_000, f"{after} kB after, {before} kB before"
        assert client.get("/v1/stats").json()["traces"] == 0


def test_limits_config_must_be_consistent() -> None:
    with pytest.raises(ValueError, match="max_queued_traces"):
        LimitsConfig(max_traces_per_request=100, max_queued_traces=10)
    with pytest.raises(ValueError, match="max_json_depth"):
        LimitsConfig(max_json_depth=300)


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


_JSON = st.recursive(
    st.none() | st.integers() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner,
                                                               max_size=3),
    max_leaves=30,
)


@given(_JSON, st.integers(min_value=1, max_value=12))
def test_json_depth_counts_nesting(value: Any, stop_after: int) -> None:
    assert json_depth(value, stop_after) == min(_depth(value), stop_after + 1)


def test_check_item_before_parsing() -> None:
    limits = LimitsConfig(max_json_depth=4, max_steps_per_trace=2)
    check_item({"steps": [1, 2], "a": {"b": {"c": 1}}}, limits)
    with pytest.raises(Invalid):
        check_item({"a": {"b": {"c": {"d": {}}}}}, limits)
    with pytest.raises(PayloadTooLarge):
        check_item({"conversations": [{}, {}, {}]}, limits)
    # Deeper than Python's recursion limit: still just a refusal.
    with pytest.raises(Invalid):
        check_item(nested(5000), limits)


MIB = 1024 * 1024


def test_bodies_in_flight_are_bounded_across_requests(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    """A 134 KB gzip body cost ~90 MB and 16 at once 1.4 GB: each request was bounded,
    their sum was not. While another body holds the budget, a gzip body that would
    inflate past it gets 503 with Retry-After, as soon as it passes it; alone, it is
    read (and refused for what it holds)."""
    limits = {"max_body_bytes": 8 * MIB, "max_body_bytes_in_flight": 4 * MIB}
    hub = start_hub(trace_server, "--no-workers", listen=True, limits=limits)
    host, port = hub.url.removeprefix("http://").rsplit(":", 1)
    bomb = gzip.compress(b'{"task": "' + b"y" * (7 * MIB) + b'"}')
    assert len(bomb) < 64 * 1024
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    with socket.create_connection((host, int(port))) as held, hub.client() as client:
        # A slow client's body, 3 MiB of it in and the rest to come.
        start = b'{"task": "' + b"x" * (3 * MIB)
        held.sendall(
            f"POST /v1/traces HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(start) + 2}\r\n\r\n"
            .encode() + start)

        def refused() -> httpx.Response | None:
            r = client.post("/v1/traces", content=bomb, headers=headers)
            # Refused for what it holds until the 3 MiB are read.
            assert r.status_code in (413, 422, 503), r.text
            return r if r.status_code == 503 else None

        r = wait_until(refused, what="the bomb refused while the slow body is held")
        assert r is not None  # wait_until returns a true value
        error = r.json()["error"]
        assert error["field"] == "limits.max_body_bytes_in_flight"
        assert error["code"] == "overloaded" and r.headers["retry-after"] == "2"

        held.sendall(b'"}')  # the slow body ends: it is answered, not refused for load
        status_line = held.recv(4096).split(b"\r\n", 1)[0]
        assert status_line.split()[1] in (b"413", b"422"), status_line  # for what it holds
        # Given back: the bomb alone is read to its end again.
        r = client.post("/v1/traces", content=bomb, headers=headers)
        assert r.status_code in (413, 422), r.text
        assert client.get("/v1/stats").json()["traces"] == 0
