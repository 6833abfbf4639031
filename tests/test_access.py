"""API keys, scopes, rate limits, docs and CORS, through the HTTP API of a live hub."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI

from app.access.keys import Scope
from app.api.openapi import install_openapi
from app.config import AuthConfig
from tests.support import REAL
from tests.support.builders import native_trace
from tests.support.clock import Clock
from tests.support.databases import db_execute
from tests.support.databases import make_api_key as make_key
from tests.support.hubs import InProcessHub
from tests.support.processes import run_cli

# key_cache_seconds 0: a revocation shows on the very next request.
AUTH = {"enabled": True, "key_cache_seconds": 0}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def secured(start_hub: Any, trace_server: dict[str, Any]) -> tuple[InProcessHub, dict[Scope, str]]:
    hub = start_hub(trace_server, auth=AUTH)
    keys = {scope: make_key(trace_server, scope, name=f"{scope}-key") for scope in Scope}
    return hub, keys


def test_no_key_or_a_wrong_one_is_401(secured: tuple[InProcessHub, dict[str, str]]) -> None:
    hub, keys = secured
    key_id = keys["admin"].split("_")[1]
    wrong = [
        {},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer not-a-key"},
        {"Authorization": f"Basic {keys['admin']}"},  # the right key, the wrong scheme
        bearer(f"ath_{key_id}_wrongsecret"),  # a real key id, a wrong secret
        bearer("ath_000000000000_" + "x" * 43),  # no such key
        bearer(keys["admin"][:-1]),
    ]
    with hub.client() as client:
        for headers in wrong:
            for method, path in [("POST", "/v1/traces"), ("GET", "/v1/traces"),
                                 ("GET", "/v1/traces/x"), ("GET", "/v1/stats")]:
                r = client.request(method, path, headers=headers, json=native_trace())
                assert r.status_code == 401, (headers, path, r.text)
                assert r.json()["error"]["code"] == "unauthorized"
                assert r.json()["error"]["field"] == "Authorization"
                assert r.headers["www-authenticate"].startswith("Bearer")
        assert client.get("/v1/stats", headers=bearer(keys["read"])).json()["traces"] == 0
    assert keys["admin"] not in hub.log


def test_scopes(secured: tuple[InProcessHub, dict[str, str]]) -> None:
    hub, keys = secured
    with hub.client() as client:
        # ingest: POST only
        r = client.post("/v1/traces", json=native_trace(trace_id="s-1"),
                        headers=bearer(keys["ingest"]))
        assert r.status_code == 202, r.text
        for path in ("/v1/traces", "/v1/traces/s-1", "/v1/stats"):
            r = client.get(path, headers=bearer(keys["ingest"]))
            assert r.status_code == 403, r.text
            assert r.json()["error"]["code"] == "insufficient_scope"
            assert "needs read" in r.json()["error"]["message"]
        # read: GET only
        r = client.post("/v1/traces", json=native_trace(trace_id="s-2"),
                        headers=bearer(keys["read"]))
        assert r.status_code == 403 and "needs ingest" in r.json()["error"]["message"]
        assert client.get("/v1/traces/s-1", headers=bearer(keys["read"])).status_code == 200
        assert client.get("/v1/traces", headers=bearer(keys["read"])).json()["traces"]
        # admin: everything
        r = client.post("/v1/traces", json=native_trace(trace_id="s-3"),
                        headers=bearer(keys["admin"]))
        assert r.status_code == 202
        assert client.get("/v1/stats", headers=bearer(keys["admin"])).json()["traces"] == 2
        # open without a key
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 200
        assert "atropos_traces" in client.get("/metrics").text
        assert client.get("/docs").status_code == 200
        doc = client.get("/openapi.json").json()
    ingest = doc["paths"]["/v1/traces"]["post"]
    assert ingest["security"] == [{"bearerAuth": ["ingest"]}]
    assert {"401", "403"} <= set(ingest["responses"])
    assert doc["paths"]["/v1/stats"]["get"]["security"] == [{"bearerAuth": ["read"]}]
    assert "security" not in doc["paths"]["/healthz"]["get"]
    assert doc["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"


@pytest.mark.process
def test_keys_cli_create_list_revoke(start_hub: Any, trace_server: dict[str, Any]) -> None:
    hub = start_hub(trace_server, auth=AUTH)
    created = run_cli("keys", "create", "--config", str(hub.config),
                      "--scope", "ingest", "--scope", "read", "--name", "ci runner")
    assert created.returncode == 0, created.stderr
    *_, key = created.stdout.strip().splitlines()
    assert key.startswith("ath_") and " " not in key
    assert key not in created.stderr
    key_id = key.split("_")[1]
    with hub.client(headers=bearer(key)) as client:
        assert client.post("/v1/traces", json=native_trace(trace_id="k-1")).status_code == 202
        assert client.get("/v1/traces/k-1").status_code == 200

        listed = run_cli("keys", "list", "--config", str(hub.config))
        assert listed.returncode == 0, listed.stderr
        line = next(row for row in listed.stdout.splitlines() if row.startswith(key_id))
        assert "ci runner" in line and "ingest,read" in line and line.endswith("active")
        assert key.split("_", 2)[2] not in listed.stdout

        revoked = run_cli("keys", "revoke", "--config", str(hub.config), key_id)
        assert revoked.returncode == 0, revoked.stderr
        assert client.get("/v1/traces/k-1").status_code == 401
        listed = run_cli("keys", "list", "--config", str(hub.config))
        assert "revoked" in next(r for r in listed.stdout.splitlines() if r.startswith(key_id))

    missing = run_cli("keys", "revoke", "--config", str(hub.config), "000000000000")
    assert missing.returncode == 1 and "no API key" in missing.stderr
    bad_scope = run_cli("keys", "create", "--config", str(hub.config),
                        "--scope", "root", "--name", "x")
    assert bad_scope.returncode == 2 and "invalid choice" in bad_scope.stderr


def test_keys_are_stored_only_as_hashes(trace_server: dict[str, Any], start_hub: Any) -> None:
    start_hub(trace_server, auth=AUTH)
    key = make_key(trace_server, "read", name="hashed")
    secret = key.split("_", 2)[2]
    rows = db_execute(trace_server, "SELECT * FROM api_keys")
    assert len(rows) == 1
    assert rows[0]["secret_hash"] == hashlib.sha256(secret.encode()).hexdigest()
    assert all(secret not in str(value) for value in rows[0].values())


def test_auth_is_off_by_default(client: httpx.Client) -> None:
    assert client.post("/v1/traces", json=native_trace()).status_code == 202
    assert client.get("/v1/stats").status_code == 200
    doc = client.get("/openapi.json").json()
    assert "security" not in doc["paths"]["/v1/traces"]["post"]
    assert "securitySchemes" not in doc.get("components", {})
    assert "401" not in doc["paths"]["/v1/traces"]["post"]["responses"]


def test_docs_can_be_turned_off(start_hub: Any, trace_server: dict[str, Any]) -> None:
    hub = start_hub(trace_server, auth={"docs_enabled": False})
    with hub.client() as client:
        for path in ("/docs", "/redoc", "/openapi.json"):
            r = client.get(path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert client.get("/healthz").status_code == 200


def test_cors_is_off_by_default_and_takes_listed_origins(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    preflight = {"Origin": "https://dash.example", "Access-Control-Request-Method": "GET",
                 "Access-Control-Request-Headers": "authorization"}
    hub = start_hub(trace_server)
    with hub.client() as client:
        assert "access-control-allow-origin" not in client.options(
            "/v1/traces", headers=preflight).headers
        r = client.get("/v1/stats", headers={"Origin": "https://dash.example"})
        assert "access-control-allow-origin" not in r.headers
    hub.stop()
    hub = start_hub(trace_server, auth={"cors_origins": ["https://dash.example"]})
    with hub.client() as client:
        r = client.options("/v1/traces", headers=preflight)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://dash.example"
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = client.get("/v1/stats", headers={"Origin": "https://dash.example"})
        assert r.headers["access-control-allow-origin"] == "https://dash.example"
        r = client.get("/v1/stats", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers


def test_rate_limit_per_key(start_hub: Any, trace_server: dict[str, Any]) -> None:
    clock = Clock()
    hub = start_hub(trace_server, clock=clock, auth={**AUTH, "rate_limit_per_second": 1,
                                                     "rate_limit_burst": 3})
    busy, other = make_key(trace_server, "read"), make_key(trace_server, "read")
    with hub.client() as client:
        answers = [client.get("/v1/stats", headers=bearer(busy)) for _ in range(5)]
        codes = [r.status_code for r in answers]
        assert codes == [200, 200, 200, 429, 429], codes
        limited = next(r for r in answers if r.status_code == 429)
        assert limited.json()["error"]["code"] == "rate_limited"
        assert limited.json()["error"]["field"] == "auth.rate_limit_per_second"
        wait = int(limited.headers["retry-after"])
        assert wait == 1  # the hub's clock stands still: a token a second, none left
        # Another key has its own bucket; the open endpoints are not limited.
        assert client.get("/v1/stats", headers=bearer(other)).status_code == 200
        assert all(client.get("/healthz").status_code == 200 for _ in range(5))
        clock.now += wait / 2
        assert client.get("/v1/stats", headers=bearer(busy)).status_code == 429
        clock.now += wait / 2  # as long as Retry-After said
        assert client.get("/v1/stats", headers=bearer(busy)).status_code == 200
        # Unauthenticated requests are refused before they count against anyone.
        assert client.get("/v1/stats").status_code == 401


def test_rate_limit_without_auth_is_per_address(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    # One token per 20 s: none comes back while the first trace is stored, however slow.
    hub = start_hub(trace_server, auth={"rate_limit_per_second": 0.05})
    with hub.client() as client:
        assert client.post("/v1/traces", json=native_trace()).status_code == 202
        r = client.post("/v1/traces", json=native_trace(trace_id="limited"))
        assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 20
        assert client.get("/v1/traces/limited").status_code == 429
        doc = client.get("/openapi.json").json()
        assert "429" in doc["paths"]["/v1/traces"]["post"]["responses"]
    assert db_execute(trace_server, "SELECT trace_id FROM traces WHERE trace_id = 'limited'") == []


@pytest.mark.process
def test_a_forwarded_address_counts_only_from_a_listed_proxy(
    start_hub_process: Any, trace_server: dict[str, Any]
) -> None:
    """X-Forwarded-For let any client on loopback pick its own address and escape the
    per-address rate limit: it is believed only from
    trace_server.forwarded_allow_ips, which lists none by default. (`atropos serve`
    itself: the headers are uvicorn's to believe.)"""
    limit = {"rate_limit_per_second": 0.05}
    hub = start_hub_process(trace_server, "--no-workers", auth=limit)
    with hub.client() as client:
        assert client.get("/v1/stats", headers={"X-Forwarded-For": "10.0.0.1"}).status_code == 200
        r = client.get("/v1/stats", headers={"X-Forwarded-For": "10.0.0.2"})
        assert r.status_code == 429 and "127.0.0.1" in r.json()["error"]["message"]

    proxied = start_hub_process({**trace_server, "forwarded_allow_ips": ["127.0.0.0/8"]},
                                "--no-workers", auth=limit)
    with proxied.client() as client:
        for address in ("10.0.0.1", "10.0.0.2"):  # two clients behind the proxy
            r = client.get("/v1/stats", headers={"X-Forwarded-For": address})
            assert r.status_code == 200, r.text
        r = client.get("/v1/stats", headers={"X-Forwarded-For": "10.0.0.1"})
        assert r.status_code == 429 and "10.0.0.1" in r.json()["error"]["message"]


@pytest.mark.process
def test_forwarded_allow_ips_takes_addresses_and_networks(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text('{"trace_server": {"forwarded_allow_ips": ["proxy.local"]}}')
    result = run_cli("serve", "--config", str(config))
    assert result.returncode == 2
    assert "trace_server.forwarded_allow_ips" in result.stderr and "network" in result.stderr


def test_an_unguarded_v1_route_stops_start_up() -> None:
    app = FastAPI()
    api = APIRouter()

    @api.get("/v1/open")
    async def open_route() -> dict[str, str]:
        return {}

    app.include_router(api)
    with pytest.raises(RuntimeError, match="GET /v1/open"):
        install_openapi(app, AuthConfig())


@pytest.mark.process
def test_auth_config_errors(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text('{"auth": {"enabled": true, "cors_origins": ["dash.example"]}}')
    result = run_cli("serve", "--config", str(config))
    assert result.returncode == 2
    assert "config.json: auth.cors_origins" in result.stderr
    config.write_text('{"auth": {"rate_limit_per_second": 0}}')
    result = run_cli("serve", "--config", str(config))
    assert result.returncode == 2 and "auth.rate_limit_per_second" in result.stderr


@pytest.mark.process
def test_import_over_http_sends_the_key_and_waits_when_told(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    hub = start_hub(trace_server, "--no-workers", listen=True,  # `import --url` needs a socket
                    auth={**AUTH, "rate_limit_per_second": 1, "rate_limit_burst": 1})
    files = str(REAL / "tau-bench")  # 200 traces: four requests, three of them limited
    refused = run_cli("import", "--config", str(hub.config), "--url", hub.url, files)
    assert refused.returncode != 0 and "401" in refused.stderr
    key = make_key(trace_server, "ingest")
    result = run_cli("import", "--config", str(hub.config), "--url", hub.url,
                     "--api-key-env", "HUB_KEY", files, env={"HUB_KEY": key})
    assert result.returncode == 0, result.stderr
    assert "stored 200," in result.stdout
    assert key not in result.stdout + result.stderr


def test_runs_need_the_admin_scope(secured: tuple[InProcessHub, dict[str, str]]) -> None:
    hub, keys = secured
    with hub.client() as client:
        for scope in ("read", "ingest"):
            for method, path in [("GET", "/v1/runs"), ("GET", "/v1/runs/x"),
                                 ("POST", "/v1/runs"), ("DELETE", "/v1/runs/x")]:
                r = client.request(method, path, headers=bearer(keys[scope]), json={})
                assert r.status_code == 403, (scope, path, r.text)
                assert r.json()["error"]["code"] == "insufficient_scope"
        assert client.get("/v1/runs").status_code == 401
        # The admin key passes the guard; these runs are off in this hub's config.
        r = client.get("/v1/runs", headers=bearer(keys["admin"]))
        assert r.status_code == 403 and r.json()["error"]["code"] == "runs_disabled"
        doc = client.get("/openapi.json").json()
    assert doc["paths"]["/v1/runs"]["post"]["security"] == [{"bearerAuth": ["admin"]}]


@pytest.mark.process
def test_a_host_header_that_names_another_site_is_refused(
    start_hub_process: Any, trace_server: dict[str, Any]
) -> None:
    """DNS rebinding: a page of attacker.example re-points its name at 127.0.0.1 and its
    scripts reach a hub bound there as their own origin, with Host: attacker.example.
    Answered are the names of this hub only."""
    hub = start_hub_process({**trace_server, "allowed_hosts": ["hub.example", "*.lab.example"]},
                            "--no-workers")
    port = hub.url.rsplit(":", 1)[1]
    with httpx.Client(base_url=hub.url) as client:
        for host in ("attacker.example", f"attacker.example:{port}", "hub.example.evil",
                     "localhost.attacker.example", "lab.example"):
            for method, path in (("GET", "/v1/stats"), ("POST", "/scored_data"),
                                 ("GET", "/ui"), ("GET", "/healthz")):
                r = client.request(method, path, headers={"Host": host}, json={})
                assert r.status_code == 400, (host, path, r.text)
                error = r.json()["error"]
                assert error["code"] == "unknown_host" and error["field"] == "Host"
                assert "trace_server.allowed_hosts" in error["message"]
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "[::1]", "hub.example",
                     f"HUB.example:{port}", "a.lab.example", "app.localhost"):
            r = client.get("/v1/stats", headers={"Host": host})
            assert r.status_code == 200, (host, r.text)


@pytest.mark.process
def test_runs_without_auth_need_saying_so(
    start_hub_process: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    """With auth off and runs.enabled, anyone who reached the port started processes,
    and nothing said so at start."""
    from tests.support.hubs import write_config

    config = write_config(tmp_path, trace_server, runs={"enabled": True})
    refused = run_cli("serve", "--config", str(config))
    assert refused.returncode == 2
    assert "runs.enabled" in refused.stderr and "runs.allow_without_auth" in refused.stderr
    assert "Trace server listening" not in refused.stderr
    hub = start_hub_process(trace_server, "--no-workers",
                            runs={"enabled": True, "allow_without_auth": True})
    hub.wait_for_log("anyone who reaches port")
    hub = start_hub_process(trace_server, "--no-workers", runs={"enabled": True}, auth=AUTH)
    assert "runs.allow_without_auth" not in hub.log
