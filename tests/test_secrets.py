"""Secret hygiene: a hub started with a known model key (in the variable tinker.json's
api_key_env names) and a known database password (in database_url), driven through
every endpoint and error path, must show neither in a log line, a response (body or
header) or a database row; nor the API keys clients send it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from app.db.models import Base
from tests.support.builders import native_trace
from tests.support.databases import db_execute, make_api_key
from tests.support.fakes.model_server import FakeModel, serve
from tests.support.hubs import write_config
from tests.support.processes import HubProcess, run_cli
from tests.support.waiting import wait_until

pytestmark = pytest.mark.process

MODEL_KEY = "sk-hygiene-model-key-4e1f0b7c2a"
PASSWORD = "pg-hygiene-password-9d2a6e31"
KEY_ENV = "HYGIENE_MODEL_KEY"


def long_trace(trace_id: str) -> dict[str, Any]:
    """Long enough for summarize_middle to call the model."""
    steps: list[dict[str, Any]] = []
    for i in range(14):
        steps += [
            {"type": "thought", "content": f"Step {i}: look at module {i} and its tests. " * 8},
            {"type": "action", "tool": "bash", "call_id": f"c{i}",
             "arguments": {"command": f"pytest tests/test_module_{i}.py -q"}},
            {"type": "observation", "call_id": f"c{i}",
             "content": f"collected {i} items; module {i} passes its checks\n" * 6, "exit_code": 0},
        ]
    steps.append({"type": "final", "content": "All modules pass."})
    return native_trace(trace_id=trace_id, steps=steps)


def exercise(client: httpx.Client, keys: dict[str, str]) -> list[httpx.Response]:
    """Every endpoint, with good input and with each kind of bad input."""
    admin = {"Authorization": f"Bearer {keys['admin']}"}
    ingest_only = {"Authorization": f"Bearer {keys['ingest']}"}
    json_type = {"content-type": "application/json"}
    calls: list[tuple[str, str, dict[str, Any]]] = [
        # the traces API, good
        ("POST", "/v1/traces", {"json": native_trace(trace_id="h-1"), "headers": admin}),
        ("POST", "/v1/traces", {"json": {"traces": [native_trace(trace_id="h-2"), {"task": 1}]},
                                "headers": admin}),
        ("POST", "/v1/traces", {"content": gzip.compress(json.dumps(native_trace()).encode()),
                                "headers": {**admin, **json_type, "content-encoding": "gzip"}}),
        ("POST", "/v1/traces", {"content": json.dumps(native_trace()) + "\n{oops\n",
                                "headers": {**admin, "content-type": "application/x-ndjson"}}),
        ("POST", "/v1/traces", {"json": long_trace("long-1"), "headers": admin}),
        ("POST", "/v1/traces", {"json": long_trace("long-2"), "headers": admin}),
        ("GET", "/v1/traces", {"headers": admin, "params": {"limit": 2}}),
        ("GET", "/v1/traces/h-1", {"headers": admin, "params": {"view": "original"}}),
        ("GET", "/v1/stats", {"headers": admin}),
        # bad input
        ("POST", "/v1/traces", {"content": b"{nope", "headers": {**admin, **json_type}}),
        ("POST", "/v1/traces", {"content": b"", "headers": {**admin, **json_type}}),
        ("POST", "/v1/traces", {"content": b"\x1f\x8bzz", "headers": {
            **admin, **json_type, "content-encoding": "gzip"}}),
        ("POST", "/v1/traces", {"content": b"<x/>", "headers": {**admin,
                                                                "content-type": "text/xml"}}),
        ("POST", "/v1/traces", {"json": native_trace(task="x" * 70_000), "headers": admin}),
        ("POST", "/v1/traces", {"json": [native_trace()] * 6, "headers": admin}),
        ("POST", "/v1/traces", {"json": {"format": "klingon"}, "headers": admin}),
        ("POST", "/v1/traces", {"json": {"task": "t", "steps": [{"type": "dance"}]},
                                "headers": admin}),
        ("POST", "/v1/traces", {"json": native_trace(trace_id="h-1", task="other"),
                                "headers": admin}),
        ("GET", "/v1/traces", {"headers": admin, "params": {"cursor": "garbage!", "limit": 0}}),
        ("GET", "/v1/traces/missing", {"headers": admin}),
        ("GET", "/v1/traces/h-1", {"headers": admin, "params": {"view": "compressed"}}),
        ("DELETE", "/v1/traces", {"headers": admin}),
        ("GET", "/v2/nothing", {}),
        # access: no key, wrong keys (one of them the model key), wrong scope, rate limit
        ("GET", "/v1/stats", {}),
        ("GET", "/v1/stats", {"headers": {"Authorization": f"Bearer {MODEL_KEY}"}}),
        ("GET", "/v1/stats", {"headers": {"Authorization": f"Basic {PASSWORD}"}}),
        ("GET", "/v1/stats", {"headers": {"Authorization": f"Bearer {keys['admin']}x"}}),
        ("GET", "/v1/stats", {"headers": ingest_only}),
        *[("GET", "/v1/traces/h-1", {"headers": ingest_only})] * 60,
        # open endpoints
        ("GET", "/healthz", {}),
        ("GET", "/readyz", {}),
        ("GET", "/metrics", {}),
        ("GET", "/docs", {}),
        ("GET", "/openapi.json", {}),
    ]
    responses = [client.request(method, path, **kwargs) for method, path, kwargs in calls]
    statuses = {r.status_code for r in responses}
    assert {200, 202, 207, 400, 401, 403, 404, 405, 409, 413, 415, 422, 429} <= statuses
    return responses


def database_rows(trace_server: dict[str, Any]) -> str:
    """Every row of every table the hub has, as text."""
    dumped = []
    for table in Base.metadata.sorted_tables:
        dumped += [repr(row) for row in db_execute(trace_server, sa.select(table))]
    dumped += [repr(db_execute(trace_server, "SELECT * FROM alembic_version"))]
    return "\n".join(dumped)


def test_no_secret_in_logs_responses_or_rows(
    trace_server: dict[str, Any], tmp_path: Path
) -> None:
    if trace_server["storage_backend"] == "postgresql":
        # The test cluster trusts local connections, so any password is accepted.
        url = make_url(trace_server["database_url"]).set(password=PASSWORD)
        trace_server = {**trace_server,
                        "database_url": url.render_as_string(hide_password=False)}
    fake = FakeModel(key=MODEL_KEY)
    # The model fails first, once echoing the key in its error (as some providers do).
    fake.faults.extend(["echo_key", "500", "401"])
    with serve(fake) as base_url:
        tinker = tmp_path / "tinker.json"
        tinker.write_text(json.dumps({"tinker": {
            "base_url": base_url + "/v1", "api_key_env": KEY_ENV, "max_retries": 1,
            "retry_base_delay_seconds": 0, "timeout_seconds": 5}}))
        compression = tmp_path / "compression.json"
        compression.write_text(json.dumps({"compression": {
            "strategy": "summarize_middle", "min_tokens_after": 50,
            "summary_target_tokens": 60, "protect_last_n_turns": 2,
            # The model's error lands in the record at once (a key it echoes would too).
            "on_model_failure": "fallback", "retry": {"max_attempts": 1}}}))
        config = write_config(
            tmp_path, {**trace_server, "flush_interval_seconds": 0.2},
            auth={"enabled": True, "rate_limit_per_second": 5, "rate_limit_burst": 50,
                  "key_cache_seconds": 0},
            limits={"max_body_bytes": 60_000, "max_traces_per_request": 5},
        )
        hub = HubProcess(config, "--compression", str(compression), "--tinker", str(tinker),
                         env={KEY_ENV: f"  {MODEL_KEY}\n"}).start()
        try:
            keys = {scope: make_api_key(trace_server, scope) for scope in ("admin", "ingest")}
            with hub.client() as client:
                responses = exercise(client, keys)
                admin = {"Authorization": f"Bearer {keys['admin']}"}
                records: list[dict[str, Any]] = []

                def compressed() -> bool:
                    records[:] = [client.get(f"/v1/traces/long-{n}", headers=admin).json()
                                  for n in (1, 2)]
                    return all(r["stage"].startswith("compress") for r in records)

                wait_until(compressed, 60, what="both long traces through compression")
                responses += [client.get(f"/v1/traces/long-{n}", headers=admin,
                                         params={"view": "compressed"}) for n in (1, 2)]
            assert any(r.headers.get("authorization") == f"Bearer {MODEL_KEY}"
                       for r in fake.received), "the model was never called with the key"
            assert not fake.faults, "every scripted model failure was met"
            assert any("HTTP 400" in r["compression"].get("fallback", "") for r in records)
        finally:
            hub.stop()

    # The error paths of start-up and of the other commands, with the same secrets.
    runs = [
        run_cli("keys", "list", "--config", str(config)),
        run_cli("prune", "--config", str(config), "--older-than", "1d", "--dry-run"),
        run_cli("db", "upgrade", "--config", str(config)),
    ]
    for bad_url in (f"postgresql://hub:{PASSWORD}@127.0.0.1:1/none",  # nothing listens
                    f"postgresql://hub:{PASSWORD}@127.0.0.1:notaport/none",  # malformed
                    f"postgresql+nodriver://hub:{PASSWORD}@127.0.0.1/none"):  # no such driver
        bad = write_config(tmp_path, {"storage_backend": "postgresql", "database_url": bad_url})
        result = run_cli("serve", "--config", str(bad), env={KEY_ENV: MODEL_KEY})
        assert result.returncode != 0
        runs.append(result)
    assert all(r.returncode == 0 for r in runs[:3]), [r.stderr for r in runs[:3]]

    seen = {
        "hub log": hub.log,
        "responses": "\n".join(
            f"{r.status_code} {dict(r.headers)} {r.text}" for r in responses),
        "database rows": database_rows(trace_server),
        "command output": "\n".join(r.stdout + r.stderr for r in runs),
    }
    assert "Trace server listening" in seen["hub log"]
    assert "compress" in seen["database rows"]
    for secret in (MODEL_KEY, PASSWORD, keys["admin"], keys["ingest"]):
        for where, text in seen.items():
            assert secret not in text, f"{secret[:12]}... appears in the {where}"
