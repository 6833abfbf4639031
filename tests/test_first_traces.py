"""The first traces after a (re)start are answered within limits.max_write_wait_seconds
while the ingest processes are still starting: the serving process prepares them
meanwhile, rather than holding them until the processes are up."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.support.builders import native_trace
from tests.support.metrics import scrape, value
from tests.support.processes import HubProcess


@pytest.mark.process
def test_traces_sent_at_start_are_answered_within_the_write_bound(
    start_hub_process: Any, trace_server: dict[str, Any]
) -> None:
    hub: HubProcess = start_hub_process(
        trace_server, "--no-workers", limits={"max_write_wait_seconds": 1})

    def post(n: int) -> httpx.Response:
        with hub.client() as client:
            return client.post("/v1/traces", json=native_trace(trace_id=f"first-{n}"))

    # Sent the moment the hub listens: the ingest processes are starting then.
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(post, range(4)))
    assert [r.status_code for r in answers] == [202] * 4, [r.text for r in answers]
    with hub.client() as client:
        _, samples = scrape(client)
    name = "atropos_http_request_duration_seconds_bucket"
    route = {"method": "POST", "route": "/v1/traces", "status": "202"}
    # The hub's own timing of each: within the 1 s bound (plus parsing), none past it.
    assert value(samples, name, le="2.5", **route) == 4, samples
    assert value(samples, name, le="+Inf", **route) == 4
