"""atropos_hub.Client and AsyncClient against a real hub: every logged trace stored
once, through a hub restarted mid-stream, 429s waited out as Retry-After says, traces
the hub refuses reported, and what is queued sent on close."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest

import atropos_hub
from atropos_hub import AsyncClient, Client
from tests.support import ROOT
from tests.support.builders import native_trace
from tests.support.fakes.vllm_server import FakeVllm, serve
from tests.support.hubs import write_config
from tests.support.processes import HubProcess
from tests.support.runs import free_port
from tests.support.waiting import wait_until

pytestmark = pytest.mark.process


def stored(url: str) -> int:
    """Traces the hub holds (asked again while a rate limit answers 429)."""
    def answered() -> httpx.Response | None:
        r = httpx.get(f"{url}/v1/stats", timeout=30)
        return r if r.status_code == 200 else None
    answer = wait_until(answered, timeout=60, what="the hub's stats")
    return int(answer.json()["traces"])


def trace(n: int) -> dict[str, Any]:
    """A trace without an id: the client gives it one."""
    item = native_trace(task=f"How many lines are in notes-{n}.txt?")
    item.pop("trace_id", None)
    return item


def test_the_package_exports_what_it_documents() -> None:
    assert sorted(atropos_hub.__all__) == ["AsyncClient", "Client", "HubError"]


def test_every_trace_is_stored_once_through_a_hub_restart(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db"), "port": free_port()},
                          )
    hub = HubProcess(config, "--no-workers").start(timeout=120)
    url = hub.url
    client = Client(url, batch_size=10, flush_interval=0.05, retry_base=0.1, retry_max=0.5,
                    close_timeout=120)
    ids = [client.log(trace(n)) for n in range(50)]
    wait_until(lambda: stored(url) >= 10, timeout=60, what="the first batches")
    assert hub.stop() == 0
    # The hub is away: logging goes on, the client holds and retries.
    ids += [client.log(trace(n)) for n in range(50, 100)]
    hub = HubProcess(config, "--no-workers").start(timeout=120)
    try:
        client.close()
        assert len(set(ids)) == 100
        assert client.refused == []
        assert client.stats.sent == 100  # each acknowledged once (some maybe as duplicates)
        assert client.stats.retries > 0
        assert stored(url) == 100
        listed = httpx.get(f"{url}/v1/traces", params={"limit": 1000}, timeout=30).json()
        assert {t["trace_id"] for t in listed["traces"]} == set(ids)
    finally:
        hub.stop()


def test_a_rate_limit_is_waited_out_and_refusals_reported(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db")},
                          auth={"rate_limit_per_second": 5, "rate_limit_burst": 1})
    hub = HubProcess(config, "--no-workers").start(timeout=120)
    try:
        with Client(hub.url, batch_size=1, flush_interval=0.01, retry_base=5) as client:
            for n in range(6):
                client.log(trace(n))
            bad = client.log({"trace_id": "no-task", "steps": []})
        # 429s came back with Retry-After (well under retry_base): all stored in time.
        assert client.stats.retries > 0
        assert client.stats.sent == 6
        assert [trace_id for trace_id, _ in client.refused] == [bad]
        assert stored(hub.url) == 6
    finally:
        hub.stop()


async def test_the_async_client_stores_every_trace_once(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db")})
    hub = HubProcess(config, "--no-workers").start(timeout=120)
    try:
        async with AsyncClient(hub.url, batch_size=7, flush_interval=0.05) as client:
            ids = [await client.log(trace(n)) for n in range(30)]
            assert await client.flush(60)
            # Logged again with the same ids: duplicates, stored once.
            for trace_id, n in zip(ids[:5], range(5)):
                await client.log({**trace(n), "trace_id": trace_id})
        assert client.stats.sent == 35 and client.stats.duplicates == 5
        assert stored(hub.url) == 30
    finally:
        hub.stop()


def test_what_is_queued_is_sent_when_the_program_exits(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db")})
    hub = HubProcess(config, "--no-workers").start(timeout=120)
    try:
        program = textwrap.dedent(f"""
            from atropos_hub import Client
            client = Client({hub.url!r}, flush_interval=60)
            for n in range(25):
                client.log({{"task": f"task {{n}}", "steps": [{{"type": "final",
                            "content": "done"}}]}})
            # no close(): the interpreter's exit flushes
        """)
        done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, timeout=120,
                              capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
        assert stored(hub.url) == 25
    finally:
        hub.stop()


def test_finish_posts_the_reward_to_the_rollout(tmp_path: Path) -> None:
    """`finish` calls the gateway's POST /v1/rollouts/{id}/finish for a rollout whose
    model call went through the hub; an unknown rollout is the hub's 404, raised."""
    fake = FakeVllm()
    with serve(fake) as upstream:
        config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db")}, gateway={
            "enabled": True, "upstream": {"base_url": upstream, "api_key_env": "UPSTREAM_KEY"}})
        hub = HubProcess(config, "--no-workers", env={"UPSTREAM_KEY": fake.key}).start(
            timeout=120)
        try:
            called = httpx.post(f"{hub.url}/v1/rollouts/rollout-1/chat/completions", json={
                "model": "policy", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
            assert called.status_code == 200, called.text
            with Client(hub.url) as client:
                answer = client.finish("rollout-1", reward=1.0, status="success")
                assert answer["rollout_id"] == "rollout-1" and answer["calls"] == 1
                with pytest.raises(atropos_hub.HubError) as unknown:
                    client.finish("no-such-rollout", reward=1.0)
                assert unknown.value.status == 404
        finally:
            hub.stop()
