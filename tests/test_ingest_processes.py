"""The ingest processes: rows come back in order, with their errors; a process that dies
fails only what it held and is replaced; the hub's process group ends with the hub."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.config import EnvironmentConfig, LimitsConfig
from app.errors import HubError, Invalid, Unavailable
from app.evaluation.environment import Environment
from app.ingest.ingestor import Preparer
from app.ingest.inserter import INSERT, PreparedTrace
from app.ingest.processes import (
    _LONG_ITEM_SECONDS,
    _SINCE,
    _SPILL_BYTES,
    IngestProcesses,
    ingest_outage,
)
from app.metrics import INGEST_RESTARTS, total
from tests.support.builders import native_trace
from tests.support.processes import HubProcess
from tests.support.waiting import wait_until, wait_until_async

PREPARER = Preparer(Environment.from_config(EnvironmentConfig()), LimitsConfig())


def in_flight(processes: IngestProcesses) -> int:
    """Calls sent to the ingest processes and not yet answered."""
    return sum(len(proc.waiting) for proc in processes._processes)


def long_trace(n: int) -> dict[str, Any]:
    step = {"type": "observation", "content": f"output line {n} " * 4000}
    return native_trace(trace_id=f"long-{n}", steps=[step] * 20)


async def test_rows_come_back_in_order_with_each_items_error() -> None:
    processes = IngestProcesses(PREPARER, 2)
    try:
        calls = [[native_trace(trace_id=f"t-{i}"), {"steps": "no"}, native_trace(trace_id=f"u-{i}")]
                 for i in range(20)]
        replies = await asyncio.gather(*(processes.rows(items, None) for items in calls))
        for i, (first, bad, last) in enumerate(replies):
            assert isinstance(first, PreparedTrace) and first.trace_id == f"t-{i}"
            assert _untimed(first) == _untimed(PreparedTrace.of(PREPARER.row(calls[i][0])))
            assert isinstance(bad, Invalid) and bad.status == 422
            assert isinstance(last, PreparedTrace) and last.trace_id == f"u-{i}"
        assert len(set(processes.pids)) == 2
    finally:
        await processes.close()


async def test_without_a_start_wait_calls_are_made_here_until_the_processes_are_up() -> None:
    """`atropos import` (start_wait=0): its first traces are not held up by the fork
    server importing the hub, and that is no outage; later calls go to the processes."""
    outage = ingest_outage()
    processes = IngestProcesses(PREPARER, 1, outage=outage, start_wait=0)
    try:
        processes.start()
        (row,) = await processes.rows([native_trace(trace_id="first")], None)
        assert isinstance(row, PreparedTrace) and row.trace_id == "first"
        assert outage.failing is None
        await wait_until_async(lambda: processes.pids != [], 120, what="the process")
        (row,) = await processes.rows([native_trace(trace_id="later")], None)
        assert isinstance(row, PreparedTrace) and row.trace_id == "later"
        assert in_flight(processes) == 0 and len(processes.pids) == 1
    finally:
        await processes.close()


async def test_a_killed_process_fails_what_it_held_and_is_replaced() -> None:
    processes = IngestProcesses(PREPARER, 1)
    restarts = total(INGEST_RESTARTS, reason="died")
    try:
        await processes.rows([native_trace()], None)  # started
        (pid,) = processes.pids
        assert pid is not None
        held = asyncio.create_task(processes.rows([long_trace(n) for n in range(200)], None))
        await wait_until_async(lambda: in_flight(processes) == 1, 10,
                               what="the process busy with it")
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(Unavailable) as refused:
            await held
        assert refused.value.status == 503 and refused.value.headers()["Retry-After"]
        (row,) = await processes.rows([native_trace(trace_id="after")], None)
        assert not isinstance(row, HubError) and row.trace_id == "after"
        assert processes.pids != [pid]
        assert total(INGEST_RESTARTS, reason="died") == restarts + 1  # in /metrics
    finally:
        await processes.close()


async def test_close_answers_what_was_sent_then_ends_the_processes() -> None:
    processes = IngestProcesses(PREPARER, 2)
    await processes.rows([native_trace()], None)
    sent = [asyncio.create_task(processes.rows([long_trace(n)], None)) for n in range(8)]
    await wait_until_async(lambda: in_flight(processes) + sum(s.done() for s in sent) == 8, 10,
                           what="written to the processes")
    pids = processes.pids
    await processes.close()
    assert [_trace_id((await s)[0]) for s in sent] == [f"long-{n}" for n in range(8)]
    for pid in pids:
        assert pid is not None and not Path(f"/proc/{pid}").exists()


async def test_close_kills_a_process_still_busy_after_the_timeout() -> None:
    processes = IngestProcesses(PREPARER, 1)
    await processes.rows([native_trace()], None)
    (pid,) = processes.pids
    held = asyncio.create_task(processes.rows([long_trace(n) for n in range(400)], None))
    await wait_until_async(lambda: in_flight(processes) == 1, 10, what="the process busy")
    await processes.close(timeout=0.2)
    with pytest.raises(Unavailable):
        await held
    assert pid is not None and not Path(f"/proc/{pid}").exists()


async def test_an_item_past_max_item_seconds_is_refused_and_its_process_replaced() -> None:
    # Preparing a trace of 32 MB of text (its JSON, hash, secret scan and token count)
    # takes 0.25-0.45 s on an idle machine, more on a busy one; the other items ~1 ms.
    limits = LimitsConfig(max_item_seconds=0.1, max_step_chars=40_000_000)
    processes = IngestProcesses(Preparer(PREPARER.environment, limits), 1)
    restarts = total(INGEST_RESTARTS, reason="too_slow")
    try:
        await processes.rows([native_trace()], None)
        (pid,) = processes.pids
        words = " ".join(f"word{n % 5000}" for n in range(4_000_000))[:32_000_000]
        slow = native_trace(trace_id="slow", steps=[{"type": "observation", "content": words}])
        batch = [native_trace(trace_id="before"), slow, native_trace(trace_id="after")]
        before, refused, after = await asyncio.wait_for(processes.rows(batch, None), 30)
        assert isinstance(refused, Invalid) and refused.status == 422
        assert refused.field == "limits.max_item_seconds"
        assert "limits.max_item_seconds (0.1 s)" in refused.message
        # The items it held beside the slow one were prepared by its successor.
        assert isinstance(before, PreparedTrace) and before.trace_id == "before"
        assert isinstance(after, PreparedTrace) and after.trace_id == "after"
        assert pid is not None and not Path(f"/proc/{pid}").exists()
        assert processes.pids != [pid]
        assert total(INGEST_RESTARTS, reason="too_slow") == restarts + 1  # in /metrics
        (row,) = await processes.rows([native_trace(trace_id="next")], None)
        assert not isinstance(row, HubError) and row.trace_id == "next"
    finally:
        await processes.close()


async def test_the_watchdog_stops_a_call_behind_others_answered_together() -> None:
    """Calls made in one turn of the event loop reach a process in one write, and it
    answers them together: while it is on the second, the first's answer is not sent
    yet. The second is still stopped at the limit, the others answered by a successor."""
    limits = LimitsConfig(max_item_seconds=0.25)
    processes = IngestProcesses(Preparer(PREPARER.environment, limits), 1)
    try:
        await processes.call(time.sleep, 0)
        (pid,) = processes.pids
        calls = [processes.call(time.sleep, 0), processes.call(time.sleep, 30),
                 processes.call(time.sleep, 0)]
        first, refused, third = await asyncio.wait_for(
            asyncio.gather(*calls, return_exceptions=True), 10)
        assert isinstance(refused, Invalid) and refused.field == "limits.max_item_seconds"
        assert (first, third) == (None, None)
        assert processes.pids != [pid]
    finally:
        await processes.close()


async def test_calls_pass_over_a_process_that_is_long_on_one_item() -> None:
    """Calls go to the first process while it keeps up; one that has been on a single
    item for long is passed over, so that a slow item holds up no other call."""
    processes = IngestProcesses(PREPARER, 2)
    try:
        await processes.call(time.sleep, 0)  # both processes started
        slow = asyncio.ensure_future(processes.call(time.sleep, 30))
        first = processes._processes[0]
        await wait_until_async(lambda: first.progress[_SINCE] and len(first.waiting) == 1,
                               what="the first process on the slow call")
        await wait_until_async(
            lambda: time.monotonic() - first.progress[_SINCE] > _LONG_ITEM_SECONDS,
            what="the slow call past _LONG_ITEM_SECONDS")
        await asyncio.wait_for(processes.call(time.sleep, 0), 10)
        assert not slow.done()
    finally:
        await processes.close(timeout=0.5)
    assert isinstance(slow.exception(), Unavailable)  # killed at close, never answered


async def test_calls_spill_to_the_next_process_once_the_first_holds_enough() -> None:
    """A small trace does not queue behind a backlog while another process sleeps: calls
    go to the first process until it holds _SPILL_BYTES of work, then to the next."""
    processes = IngestProcesses(PREPARER, 2)
    try:
        await processes.call(time.sleep, 0)  # both processes started
        first, second = processes._processes
        assert await processes._pick() is first
        backlog = asyncio.ensure_future(processes.call(len, b"x" * _SPILL_BYTES))
        await asyncio.sleep(0)  # one turn: the call is queued; its answer is read later
        assert first.held >= _SPILL_BYTES
        assert await processes._pick() is second
        assert await backlog == _SPILL_BYTES
        assert await processes._pick() is first
    finally:
        await processes.close()


def _sqlite(tmp_path: Path) -> dict[str, Any]:
    return {"storage_backend": "sqlite", "db_path": str(tmp_path / "traces.db")}


@pytest.mark.process
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "systemd"])
def test_a_stop_signal_to_the_whole_group_finishes_requests_in_flight(
    start_hub_process: Any, tmp_path: Path, sig: signal.Signals
) -> None:
    """Ctrl-C in a terminal, or systemd stopping the service, signals every process of
    the job, ingest processes too: they keep preparing until the hub has answered what
    it accepted."""
    hub: HubProcess = start_hub_process(_sqlite(tmp_path), "--no-workers")
    acknowledged: list[str] = []
    stop = threading.Event()

    def sender(n: int) -> None:
        with hub.client() as client:
            for i in range(10_000):
                if stop.is_set():
                    return
                try:
                    r = client.post("/v1/traces", json=long_trace(n * 10_000 + i))
                except httpx.TransportError:
                    return
                assert r.status_code == 202, r.text
                acknowledged.append(r.json()["trace_id"])

    threads = [threading.Thread(target=sender, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: len(acknowledged) >= 8, 60, what="8 traces acknowledged", poll=0.01)
    assert hub.proc is not None
    os.killpg(hub.proc.pid, sig)  # once: a second signal forces the exit
    assert hub.wait(timeout=30) == 0
    stop.set()
    for t in threads:
        t.join()
    assert "Traceback" not in hub.log and "ingest process stopped" not in hub.log, hub.log
    hub.start()
    with hub.client() as client:
        for trace_id in acknowledged:
            assert client.get(f"/v1/traces/{trace_id}").status_code == 200, trace_id
    hub.stop()


@pytest.mark.process
def test_a_stop_signal_while_the_processes_start_ends_within_dockers_stop_timeout(
    start_hub_process: Any, tmp_path: Path
) -> None:
    """SIGTERM to the group as soon as the hub listens, while its fork server imports the
    hub: the fork server was killed, started again by the next process start, and
    waited for (10.2-10.8 s, past Docker's default 10 s before SIGKILL)."""
    hub: HubProcess = start_hub_process(_sqlite(tmp_path), "--no-workers")
    assert hub.proc is not None
    os.killpg(hub.proc.pid, signal.SIGTERM)
    assert hub.wait(timeout=10) == 0
    assert "Traceback" not in hub.log, hub.log


@pytest.mark.process
def test_ingest_processes_start_with_the_hub_and_die_with_it(
    start_hub_process: Any, tmp_path: Path
) -> None:
    """Started at start-up, before any trace; a hub killed with -9 leaves none behind."""
    hub: HubProcess = start_hub_process(_sqlite(tmp_path) | {"ingest_processes": 2},
                                        "--no-workers")
    wait_until(lambda: len(hub.forked()) >= 3, 20, what="the fork server and two processes")
    assert len(hub.forked()) == 3
    hub.kill()
    wait_until(lambda: not hub.group(), 10, what=f"the group to end: {hub.group()}")


def _trace_id(row: PreparedTrace | HubError) -> str:
    assert isinstance(row, PreparedTrace), row
    return row.trace_id


def _untimed(row: PreparedTrace) -> tuple[Any, ...]:
    """The row but for when it was made."""
    times = {INSERT.columns.index("created_at"), INSERT.columns.index("updated_at")}
    values = tuple(v for i, v in enumerate(row.values) if i not in times)
    return values, row.stored, row.content_hash
