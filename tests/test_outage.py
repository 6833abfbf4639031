"""The database going away while the hub runs, and coming back: every route answers 503
with Retry-After (never a 500, never a request left hanging), nothing answered 503 is
written later, /readyz follows every writer, and the outage is said once."""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from app.outage import Outage
from tests.support.builders import native_trace
from tests.support.hubs import InProcessHub
from tests.support.otlp import document, trace_id, weather_run
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

TRAINER = {
    "wandb_group": "group", "wandb_project": "project", "batch_size": 2,
    "max_token_len": 512, "checkpoint_dir": "/tmp/checkpoints",
    "save_checkpoint_interval": 10, "starting_step": 0, "num_steps": 100,
}


def _group(marker: int) -> dict[str, Any]:
    return {"tokens": [[marker, 11, 12, 13 + i] for i in range(2)],
            "masks": [[-100, -100, 12, 13 + i] for i in range(2)],
            "scores": [0.0, 1.0], "env_id": None}


def _unavailable(r: httpx.Response) -> None:
    assert r.status_code == 503, (r.request.url.path, r.status_code, r.text)
    assert int(r.headers["retry-after"]) >= 1, r.headers


def test_postgresql_gone_is_503_on_every_route_and_nothing_is_stored_twice(
    start_hub: Any, trace_server: dict[str, Any], dialect: str
) -> None:
    if dialect != "postgresql":
        pytest.skip("a database server to take away: PostgreSQL")
    url = make_url(trace_server["database_url"])
    with TcpProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        proxied = url.set(host="127.0.0.1", port=proxy.port)
        hub: InProcessHub = start_hub(
            {**trace_server, "database_url": proxied.render_as_string(hide_password=False)},
            "--no-workers", limits={"max_write_wait_seconds": 1, "retry_after_seconds": 3},
        )
        with hub.client() as client:
            assert client.post("/register", json=TRAINER).status_code == 200
            assert client.get("/batch").status_code == 200  # the run starts
            assert client.post("/scored_data", json=_group(1)).status_code == 200
            assert client.post("/scored_data", json=_group(2)).status_code == 200
            leased = client.get("/batch", params={"ack": 1}).json()
            assert leased["batch_id"]
            proxy.cut()
            started = time.monotonic()
            _unavailable(client.post("/v1/traces", json=document(weather_run(trace_id()))))
            _unavailable(client.post("/v1/traces", json=native_trace(trace_id="during")))
            resent = _group(3)
            _unavailable(client.post("/scored_data", json=resent))
            _unavailable(client.post("/batch/ack", json={"batch_id": leased["batch_id"]}))
            _unavailable(client.get("/status"))
            assert client.get("/readyz").status_code == 503
            # Each answered within the write bound (plus the connection attempt).
            assert time.monotonic() - started < 30
            proxy.restore()
            wait_until(lambda: client.get("/readyz").status_code == 200, timeout=30,
                       what="/readyz 200 once the database is back")
            # The env sends its group again: stored once, as it was never stored before.
            assert client.post("/scored_data", json=resent).status_code == 200
            assert client.post("/batch/ack", json={"batch_id": leased["batch_id"]}
                               ).status_code == 200
            assert client.get("/status").json()["queue_size"] == 1
            assert client.get("/v1/traces/during").status_code == 404
    assert not [line for line in hub.lines if "Traceback" in line], hub.log
    failing = [line for line in hub.lines if "the database is failing" in line]
    assert failing and len(failing) <= 3, failing  # once per kind of failure
    assert sum("the database works again" in line for line in hub.lines) == 1


def test_an_outage_is_said_once_per_kind_and_once_when_it_works_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outage = Outage("the summary model", "traces wait", logger="atropos.test",
                    classify=lambda exc: (type(exc).__name__, str(exc))
                    if isinstance(exc, ConnectionError) else None)
    with caplog.at_level(logging.INFO, "atropos.test"):
        assert not outage.failed(ValueError("a bug"), "summarizing")
        assert outage.failing is None
        for doing in ("summarizing trace a", "summarizing trace b", "delivering"):
            assert outage.failed(ConnectionResetError("reset"), doing)
        assert outage.failed(ConnectionRefusedError("refused"), "summarizing trace c")
        assert outage.failing == "refused"
        outage.works()
        outage.works()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("the summary model is failing (ConnectionResetError, while "
                               "summarizing trace a): reset; traces wait")
    assert lines[1].startswith("the summary model is failing (ConnectionRefusedError")
    assert lines[2].startswith("the summary model works again after ")
    assert "4 failures: 3 ConnectionResetError, 1 ConnectionRefusedError" in lines[2]
    assert outage.failing is None
