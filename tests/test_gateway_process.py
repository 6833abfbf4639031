"""The gateway under kill -9 (its own process): no call whose answer the agent received
is lost, nor a finish the hub acknowledged."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import StartHubProcess
from tests.support.fakes.vllm_server import FakeVllm, serve
from tests.support.processes import HubProcess
from tests.support.waiting import wait_until

pytestmark = pytest.mark.process
KEY_ENV = "GATEWAY_TEST_UPSTREAM_KEY"


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
