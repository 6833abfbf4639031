"""The first traces after a (re)start are answered while the ingest processes are still
starting: past limits.max_write_wait_seconds the serving process prepares them, rather
than holding them until the processes are up (a fork server importing the hub on a
loaded machine takes many seconds)."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.support.builders import native_trace
from tests.support.processes import HubProcess
from tests.support.waiting import wait_until


@pytest.mark.process
def test_traces_sent_while_the_processes_cannot_start_are_answered(
    start_hub_process: Any, trace_server: dict[str, Any]
) -> None:
    hub: HubProcess = start_hub_process(
        trace_server, "--no-workers", limits={"max_write_wait_seconds": 1})
    # Stopped while it imports the hub (about a second): no ingest process starts until
    # it goes on.
    fork_server = wait_until(hub.forked, 20, what="the fork server")
    for pid in fork_server:
        os.kill(pid, signal.SIGSTOP)
    try:
        def post(n: int) -> httpx.Response:
            with hub.client() as client:
                return client.post("/v1/traces", json=native_trace(trace_id=f"first-{n}"))

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(post, range(4)))
        assert [r.status_code for r in answers] == [202] * 4, [r.text for r in answers]
        assert hub.forked() == fork_server, "an ingest process started"
        with hub.client() as client:
            for n in range(4):
                assert client.get(f"/v1/traces/first-{n}").status_code == 200
        # Said once the 1 s bound has passed (the hub's log is read as it comes).
        wait_until(lambda: "preparing in the serving process meanwhile" in hub.log, 10,
                   what="the hub to say so")
    finally:
        for pid in fork_server:
            os.kill(pid, signal.SIGCONT)
    # Once the fork server goes on, the processes start and take the traces.
    wait_until(lambda: len(hub.forked()) > 1, 20, what="an ingest process")
    with hub.client() as client:
        assert client.post("/v1/traces", json=native_trace(trace_id="later")).status_code == 202
