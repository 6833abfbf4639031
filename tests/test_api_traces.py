"""POST/GET /v1/traces on a live hub, over both databases."""

from __future__ import annotations

import gzip
import json
from typing import Any

import httpx
import pytest

from tests.support import REAL
from tests.support.builders import native_trace


def post(client: httpx.Client, body: Any, **kwargs: Any) -> httpx.Response:
    return client.post("/v1/traces", json=body, **kwargs)


def test_one_trace_is_stored_and_read_back(client: httpx.Client) -> None:
    r = post(client, native_trace(trace_id="t-1"))
    assert r.status_code == 202, r.text
    answer = r.json()
    assert answer["trace_id"] == "t-1"
    # A short trace enters past compression, which keeps it whole (ratio x tokens under
    # min_tokens_after), its reason recorded as the compression stage records it.
    assert answer["stage"] == "compression_skipped"
    assert answer["status"] == "success"
    assert answer["total_tokens"] > 10
    assert answer["reject_reasons"] == []

    record = client.get("/v1/traces/t-1").json()
    assert record["stage"] == "compression_skipped"
    assert "min_tokens_after" in record["compression"]["skipped"]
    assert record["status"] == "success"
    assert record["total_tokens"] == answer["total_tokens"]
    assert record["compressed_tokens"] is None
    steps = record["trace"]["steps"]
    assert [s["type"] for s in steps] == ["thought", "action", "observation", "final"]
    assert steps[1]["arguments"] == {"command": "wc -l notes.txt"}

    original = client.get("/v1/traces/t-1", params={"view": "original"}).json()
    assert original["trace"] == native_trace(trace_id="t-1")


def test_total_tokens_count_the_system_prompt_and_tool_schemas(client: httpx.Client) -> None:
    # A real Hermes line: ~12k tokens of tool schemas in its system prompt, 68 without.
    line = (REAL / "hermes-agent/lucifexia_trajectory_samples.jsonl").read_bytes()
    r = client.post("/v1/traces", content=line, headers={"content-type": "application/x-ndjson"})
    assert r.status_code == 207, r.text
    [answer] = r.json()["results"]
    assert answer["total_tokens"] > 11_000
    assert client.get(f"/v1/traces/{answer['trace_id']}").json()["total_tokens"] > 11_000


def test_trace_without_id_gets_one(client: httpx.Client) -> None:
    answer = post(client, native_trace()).json()
    assert len(answer["trace_id"]) == 32
    assert client.get(f"/v1/traces/{answer['trace_id']}").status_code == 200


def test_same_trace_again_answers_the_stored_result(client: httpx.Client) -> None:
    first = post(client, native_trace(trace_id="dup")).json()
    # Same content, other key order and whitespace: still the same trace.
    body = json.dumps(native_trace(trace_id="dup"), indent=2, sort_keys=True)
    again = client.post("/v1/traces", content=body, headers={"content-type": "application/json"})
    assert again.status_code == 202
    # The stored result, as it stands now (the pipeline may have moved it on).
    assert again.json() | {"stage": None} == first | {"duplicate": True, "stage": None}
    assert client.get("/v1/stats").json()["traces"] == 1


def test_other_content_under_a_known_id_is_a_conflict(client: httpx.Client) -> None:
    post(client, native_trace(trace_id="c-1"))
    r = post(client, native_trace(trace_id="c-1", task="Something else"))
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "conflict"
    assert r.json()["error"]["field"] == "trace_id"
    assert client.get("/v1/traces/c-1").json()["trace"]["task"] == native_trace()["task"]


def test_batch_answers_each_item_in_order(client: httpx.Client) -> None:
    items = [native_trace(trace_id="b-1"), {"task": 5, "steps": []}, native_trace(trace_id="b-2")]
    r = post(client, {"traces": items})
    assert r.status_code == 207
    results = r.json()["results"]
    assert [res.get("trace_id") for res in results] == ["b-1", None, "b-2"]
    assert results[1]["error"]["code"] == "invalid"
    assert "task" in results[1]["error"]["field"]
    # A top-level array reads the same way.
    r = post(client, [native_trace(trace_id="b-3")])
    assert r.status_code == 207 and r.json()["results"][0]["trace_id"] == "b-3"
    assert client.get("/v1/stats").json()["traces"] == 3


def test_batch_with_the_same_id_twice_stores_it_once(client: httpx.Client) -> None:
    results = post(client, {"traces": [native_trace(trace_id="x")] * 3}).json()["results"]
    assert [r["duplicate"] for r in results] == [False, True, True]
    assert client.get("/v1/stats").json()["traces"] == 1


def test_ndjson_with_a_bad_line(client: httpx.Client) -> None:
    lines = [json.dumps(native_trace(trace_id="n-1")), "{not json", "",
             json.dumps(native_trace(trace_id="n-2"))]
    r = client.post(
        "/v1/traces",
        content="\n".join(lines) + "\n",
        headers={"content-type": "application/x-ndjson"},
    )
    assert r.status_code == 207
    results = r.json()["results"]
    assert len(results) == 3
    assert results[0]["trace_id"] == "n-1" and results[2]["trace_id"] == "n-2"
    assert results[1]["error"] == {
        "code": "malformed_json", "field": "line 2", "message": results[1]["error"]["message"]
    }


def test_gzip_body(client: httpx.Client) -> None:
    body = gzip.compress(json.dumps(native_trace(trace_id="gz")).encode())
    r = client.post(
        "/v1/traces",
        content=body,
        headers={"content-type": "application/json", "content-encoding": "gzip"},
    )
    assert r.status_code == 202, r.text
    assert r.json()["trace_id"] == "gz"


def test_gzip_of_several_members_is_read_whole(client: httpx.Client) -> None:
    """`gzip -c a.jsonl b.jsonl` writes one member per file (RFC 1952); the second one
    was dropped without a word."""
    a, b = (json.dumps(native_trace(trace_id=name)).encode() + b"\n" for name in ("a", "b"))
    r = client.post(
        "/v1/traces",
        content=gzip.compress(a) + gzip.compress(b) + b"\x00" * 8,  # padding, as tapes do
        headers={"content-type": "application/x-ndjson", "content-encoding": "gzip"},
    )
    assert r.status_code == 207, r.text
    assert [item["trace_id"] for item in r.json()["results"]] == ["a", "b"]
    r = client.post(
        "/v1/traces",
        content=gzip.compress(a) + b"not gzip",
        headers={"content-type": "application/x-ndjson", "content-encoding": "gzip"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_gzip"


def test_batch_envelope_and_array_are_taken_apart_item_by_item(client: httpx.Client) -> None:
    openai = {"messages": [{"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "4"}]}
    body = {"note": {"traces": []}, "traces": [{**openai, "trace_id": "o-1"}],
            "format": "openai"}
    r = post(client, body)
    assert r.status_code == 207 and r.json()["results"][0]["trace_id"] == "o-1"
    # A trace that mentions "traces" is still one trace.
    r = post(client, native_trace(trace_id="one", task='count the "traces"'))
    assert r.status_code == 202 and r.json()["trace_id"] == "one"
    for bad in (b'[{"task": "x"} {"task": "y"}]', b'{"traces": [{}]} trailing',
                b'[{"task": "x"}', b'{"traces": [], "a": }'):
        r = client.post("/v1/traces", content=bad, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "malformed_json", bad
    # An item that is JSON to some parsers only: refused alone, its neighbours stored.
    r = client.post("/v1/traces", content=b'[{"task": "x", "steps": [], "n": NaN}, '
                    + json.dumps(native_trace(trace_id="after-nan")).encode() + b"]",
                    headers={"content-type": "application/json"})
    first, second = r.json()["results"]
    assert first["error"]["code"] == "malformed_json" and second["trace_id"] == "after-nan"


@pytest.mark.parametrize(
    "content, headers, status, code",
    [
        (b"{not json", {}, 400, "malformed_json"),
        (b"", {}, 400, "empty_body"),
        (b"   \n", {}, 400, "empty_body"),
        (b"\x1f\x8b garbage", {"content-encoding": "gzip"}, 400, "bad_gzip"),
        (b"{}", {"content-encoding": "br"}, 415, "unsupported_media_type"),
        (b"{}", {"content-type": "application/xml"}, 415, "unsupported_media_type"),
        (b"[1, 2]", {}, 207, None),
        (b'"a string"', {}, 422, "invalid"),
        (b'{"task": "x", "steps": [{"type": "dance"}]}', {}, 422, "invalid"),
        (b'{"task": "x", "steps": "no"}', {}, 422, "invalid"),
        (b'{"format": "klingon", "task": "x"}', {}, 422, "unknown_format"),
        (b'{"hello": "world"}', {}, 422, "unknown_format"),  # JSON, but no trace
        (b'{"traces": 5}', {}, 400, "bad_request"),
    ],
)
def test_bad_input_is_a_clear_4xx(
    client: httpx.Client, content: bytes, headers: dict[str, str], status: int, code: str | None
) -> None:
    r = client.post("/v1/traces", content=content,
                    headers={"content-type": "application/json", **headers})
    assert r.status_code == status, r.text
    if code:
        assert r.json()["error"]["code"] == code
        assert r.json()["error"]["message"]
    else:
        assert all("error" in item for item in r.json()["results"])
    assert client.get("/v1/stats").json()["traces"] == 0


def test_nul_characters_are_stored_the_same_on_both_databases(client: httpx.Client) -> None:
    """PostgreSQL's text and jsonb cannot hold NUL, SQLite can: a trace with one sank its
    whole group commit on PostgreSQL. Agents write them (smolagents reading a
    binary file, in the real corpus): stored as U+FFFD on both, everywhere."""
    nul = native_trace(trace_id="nul", env="sh\x00ell",
                       steps=[{"type": "observation", "content": "PK\x03\x04\x00\x00"}],
                       metadata={"k\x00": "v"})
    r = post(client, [nul, native_trace(trace_id="beside")])
    assert [item.get("trace_id") for item in r.json()["results"]] == ["nul", "beside"], r.text
    for view in ("canonical", "original"):
        stored = client.get("/v1/traces/nul", params={"view": view}).json()
        text = json.dumps(stored)  # every character past ASCII as \\uXXXX
        assert "\\u0000" not in text and "PK\\u0003\\u0004\\ufffd\\ufffd" in text, (view, text)
        assert "sh\\ufffdell" in text and "k\\ufffd" in text
    # Sent again, it is the same trace.
    assert post(client, nul).json()["duplicate"] is True
    # The text \\u0000 (a backslash, then u0000) is no NUL, and is kept as sent.
    assert post(client, native_trace(trace_id="text", task="say \\u0000")).status_code == 202
    assert client.get("/v1/traces/text").json()["trace"]["task"] == "say \\u0000"
    # Too long for a String(200) column: PostgreSQL refused it, SQLite stored it.
    r = post(client, native_trace(trace_id="long-env", env="e" * 201))
    assert r.status_code == 422 and r.json()["error"]["field"] == "env"
    assert client.get("/v1/stats").json()["traces"] == 3


def test_trace_ids_with_slashes_are_read_back_and_control_characters_refused(
    client: httpx.Client,
) -> None:
    for trace_id in ("swe-bench/django-1234/run-3", "a/b", "x%2Fy", "a b"):
        assert post(client, native_trace(trace_id=trace_id)).status_code == 202, trace_id
        quoted = httpx.URL(f"/v1/traces/{trace_id.replace('%', '%25').replace('/', '%2F')}")
        for path in (f"/v1/traces/{trace_id.replace('%', '%25')}", quoted):
            r = client.get(path)
            assert r.status_code == 200 and r.json()["trace_id"] == trace_id, (path, r.text)
    # A trace_id goes into log lines: one that could forge a line is refused.
    for trace_id in ("a\nERROR forged", "a\rb", "a\x1b[31mred", "a\u2028b", "a\u202eb"):
        r = post(client, native_trace(trace_id=trace_id))
        assert r.status_code == 422 and r.json()["error"]["field"] == "trace_id", trace_id


def test_body_limit(start_hub: Any, trace_server: dict[str, Any]) -> None:
    hub = start_hub(trace_server, limits={"max_body_bytes": 2000})
    with hub.client() as client:
        big = native_trace(task="x" * 3000)
        r = post(client, big)
        assert r.status_code == 413
        assert r.json()["error"]["field"] == "limits.max_body_bytes"
        # A small gzip body that inflates past the limit is refused too.
        bomb = gzip.compress(json.dumps(big).encode())
        assert len(bomb) < 2000
        r = client.post("/v1/traces", content=bomb,
                        headers={"content-type": "application/json", "content-encoding": "gzip"})
        assert r.status_code == 413
        assert post(client, native_trace()).status_code == 202


def test_list_filters_and_cursor(client: httpx.Client) -> None:
    for i in range(7):
        status = "success" if i % 2 else "failure"
        post(client, native_trace(trace_id=f"l-{i}", outcome={"status": status},
                                  env="maze" if i < 3 else "shell"))
    page = client.get("/v1/traces", params={"limit": 3}).json()
    assert [t["trace_id"] for t in page["traces"]] == ["l-6", "l-5", "l-4"]
    seen = [t["trace_id"] for t in page["traces"]]
    while page["next_cursor"]:
        page = client.get("/v1/traces", params={"limit": 3, "cursor": page["next_cursor"]}).json()
        seen += [t["trace_id"] for t in page["traces"]]
    assert seen == [f"l-{i}" for i in reversed(range(7))]

    def ids(**params: Any) -> list[str]:
        return [t["trace_id"] for t in client.get("/v1/traces", params=params).json()["traces"]]

    assert ids(status="success") == ["l-5", "l-3", "l-1"]
    assert ids(env="maze", status="failure") == ["l-2", "l-0"]
    assert ids(stage="rejected") == []
    assert ids(model="example/model-8b", limit=2) == ["l-6", "l-5"]
    assert ids(since="2000-01-01T00:00:00Z", until="2001-01-01T00:00:00Z") == []
    # An age, as the CLI's --since takes it.
    assert len(ids(since="1h")) == 7 and ids(until="1h") == []
    assert ids(since="7d", env="maze") == ["l-2", "l-1", "l-0"]
    assert client.get("/v1/traces", params={"since": "yesterday"}).status_code == 422
    assert client.get("/v1/traces", params={"cursor": "garbage!"}).status_code == 400
    assert client.get("/v1/traces", params={"limit": 0}).status_code == 422


def test_missing_trace_and_views(client: httpx.Client) -> None:
    r = client.get("/v1/traces/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    post(client, native_trace(trace_id="v"))
    r = client.get("/v1/traces/v", params={"view": "compressed"})
    assert r.status_code == 404 and r.json()["error"]["field"] == "view"
    assert client.get("/v1/traces/v", params={"view": "sideways"}).status_code == 422


def test_stats_health_ready_metrics(client: httpx.Client) -> None:
    post(client, native_trace(trace_id="s-1"))
    post(client, native_trace(trace_id="s-2", outcome={"status": "failure"}))
    stats = client.get("/v1/stats").json()
    assert stats["traces"] == 2
    assert sum(stats["by_stage"].values()) == 2
    assert stats["by_status"] == {"success": 1, "failure": 1}
    assert stats["total_tokens"] > 0
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    metrics = client.get("/metrics").text
    assert "atropos_traces{stage=" in metrics
    assert client.get("/docs").status_code == 200
    assert "/v1/traces" in client.get("/openapi.json").json()["paths"]


def test_unknown_route_is_json(client: httpx.Client) -> None:
    r = client.get("/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = client.delete("/v1/traces")
    assert r.status_code == 405 and "error" in r.json()
