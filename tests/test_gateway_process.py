"""The gateway under kill -9 (its own process): no call whose answer the agent received
is lost, nor a finish the hub acknowledged."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2  # the HTTP client the openai SDK is built on
import openai
import pytest

from tests.conftest import StartHubProcess
from tests.support.fakes.vllm_server import FakeVllm, serve
from tests.support.processes import HubProcess
from tests.support.waiting import wait_until

pytestmark = pytest.mark.process
KEY_ENV = "GATEWAY_TEST_UPSTREAM_KEY"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def upstream(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeVllm, str]]:
    fake = FakeVllm()
    monkeypatch.setenv(KEY_ENV, fake.key)
    with serve(fake) as url:
        yield fake, url


def _hub(start: StartHubProcess, trace_server: dict[str, Any], url: str) -> HubProcess:
    return start(trace_server, gateway={
        "enabled": True, "upstream": {"base_url": url, "api_key_env": KEY_ENV},
        "routes": [{"model": "*", "add": {"return_token_ids": True}}]})


def _trajectory(hub: HubProcess, rollout_id: str) -> dict[str, Any]:
    def stored() -> dict[str, Any] | None:
        with hub.client() as c:
            r = c.get(f"/v1/traces/{rollout_id}")
        return dict(r.json()) if r.status_code == 200 else None
    return wait_until(stored, 60, what=f"trajectory {rollout_id}")


def test_kill_during_a_stream_loses_no_call_whose_answer_was_received(
    start_hub_process: StartHubProcess, trace_server: dict[str, Any],
    upstream: tuple[FakeVllm, str],
) -> None:
    fake, url = upstream
    hub = _hub(start_hub_process, trace_server, url)
    client = openai.OpenAI(base_url=f"{hub.url}/v1/rollouts/killed-1", api_key="k",
                           max_retries=0)
    answered = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "first"}])
    assert answered.choices[0].message.content == "The answer is 42."
    fake.reply = lambda body: "a long answer " * 50
    fake.chunk_delay = 0.05
    stream = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "second"}], stream=True)
    for n, _ in enumerate(stream):
        if n == 3:
            hub.kill()  # mid-stream: this answer never reaches its end
            break
    with pytest.raises((httpx.HTTPError, openai.APIError)):
        for _ in stream:
            pass
    hub.start()
    with hub.client() as c:
        assert c.post("/v1/rollouts/killed-1/finish", json={"reward": 1.0}).status_code == 200
    record = _trajectory(hub, "killed-1")
    calls = record["trace"]["metadata"]["gateway"]["calls"]
    assert calls[0]["status"] == 200 and calls[0]["token_ids"] is True
    assert record["trace"]["task"] == "first"
    assert record["env_reward"] == 1.0


def test_kill_after_a_finish_keeps_the_finish(
    start_hub_process: StartHubProcess, trace_server: dict[str, Any],
    upstream: tuple[FakeVllm, str],
) -> None:
    _, url = upstream
    hub = _hub(start_hub_process, trace_server, url)
    with hub.client() as c:
        r = c.post("/v1/rollouts/killed-2/chat/completions",
                   json={"model": "policy", "messages": [{"role": "user", "content": "go"}]})
        assert r.status_code == 200
        assert c.post("/v1/rollouts/killed-2/finish",
                      json={"reward": 4.0, "status": "success"}).status_code == 200
    hub.kill()
    hub.start()
    record = _trajectory(hub, "killed-2")
    assert record["env_reward"] == 4.0 and record["status"] == "success"


def _rss_mb(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


@pytest.fixture
def upstream_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The fake upstream in a process of its own (500 streams at once are more than it
    serves beside their clients in one interpreter); its base URL."""
    monkeypatch.setenv(KEY_ENV, FakeVllm().key)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.fakes.vllm_server", str(port)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}/v1"

    def answers() -> bool:
        assert proc.poll() is None, "the fake upstream exited"
        try:
            return httpx.get(url + "/models").status_code == 401  # it wants its key
        except httpx.HTTPError:
            return False
    try:
        wait_until(answers, 60, what="the fake upstream")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.soak
async def test_500_concurrent_streams_are_each_passed_and_captured_in_bounded_memory(
    start_hub_process: StartHubProcess, trace_server: dict[str, Any], upstream_process: str,
) -> None:
    # The machine running the tests is shared: commits may wait longer than the default.
    hub = start_hub_process(trace_server, gateway={
        "enabled": True, "upstream": {"base_url": upstream_process, "api_key_env": KEY_ENV}},
        limits={"max_write_wait_seconds": 60})
    assert hub.proc is not None
    before = _rss_mb(hub.proc.pid, "VmRSS")
    client = openai.AsyncOpenAI(base_url=f"{hub.url}/v1", api_key="k", max_retries=0,
                                timeout=240, http_client=openai.DefaultAsyncHttpxClient(
                                    limits=httpx2.Limits(max_connections=600), timeout=240))

    async def one(i: int) -> tuple[str, str]:
        answer = await client.chat.completions.with_raw_response.create(
            model="policy", messages=[{"role": "user", "content": str(i)}], stream=True)
        text = ""
        async for chunk in answer.parse():
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        return answer.headers["x-rollout-id"], text

    try:
        results = await asyncio.gather(*(one(i) for i in range(500)))
    finally:
        await client.close()
    assert [text for _, text in results] == ["The answer is 42."] * 500
    assert len({rollout for rollout, _ in results}) == 500  # each a new conversation
    # Every call was committed before its last byte: all 500 are stored now.
    with hub.client() as c:
        assert c.get("/v1/stats").json()["gateway"]["calls"] == 500
    # No answer is buffered whole: 500 streams at once cost the hub little memory.
    assert _rss_mb(hub.proc.pid, "VmHWM") - before < 200
