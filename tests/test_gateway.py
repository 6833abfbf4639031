"""The gateway (app/gateway): real clients (the openai SDK, atroposlib's server class)
through a hub on 127.0.0.1 to a vLLM-like fake upstream, every call captured, each
rollout one trajectory with its exact tokens."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from app.formats import stitching
from tests.conftest import StartHub
from tests.support.fakes.vllm_server import END, FakeVllm, prompt_ids, serve
from tests.support.hubs import InProcessHub
from tests.support.waiting import wait_until, wait_until_async

KEY_ENV = "GATEWAY_TEST_UPSTREAM_KEY"
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
# What a trainer adds for its agents, so that they need not ask.
TRAINING_ROUTE = {"model": "*", "upstream_model": "fake-policy", "version": "step-7",
                  "add": {"return_token_ids": True, "logprobs": True}}


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[FakeVllm, str]]:
    fake = FakeVllm()
    with serve(fake) as url:
        yield fake, url


@pytest.fixture
def fake(upstream: tuple[FakeVllm, str], monkeypatch: pytest.MonkeyPatch) -> FakeVllm:
    upstream[0].reset()
    monkeypatch.setenv(KEY_ENV, upstream[0].key)
    return upstream[0]


def gateway_hub(start_hub: StartHub, trace_server: dict[str, Any], url: str,
                **gateway: Any) -> InProcessHub:
    section = {"enabled": True, "upstream": {"base_url": url, "api_key_env": KEY_ENV},
               "routes": [TRAINING_ROUTE], "quiet_seconds": 30, **gateway}
    return start_hub(trace_server, listen=True, gateway=section,
                     environment={"invalid_trace_filters": []})


@pytest.fixture
def hub(start_hub: StartHub, trace_server: dict[str, Any],
        upstream: tuple[FakeVllm, str], fake: FakeVllm) -> InProcessHub:
    return gateway_hub(start_hub, trace_server, upstream[1])


def trace(hub: InProcessHub, trace_id: str, view: str = "canonical") -> dict[str, Any]:
    def stored() -> httpx.Response | None:
        with hub.client() as c:
            r = c.get(f"/v1/traces/{trace_id}", params={"view": view})
        return r if r.status_code != 404 or "no trace" not in r.text else None
    answer = wait_until(stored, 30, what=f"trace {trace_id}")
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def tool_loop(client: openai.OpenAI, stream: bool = False) -> list[dict[str, Any]]:
    """An agent's loop: ask, run the tool it calls, ask again; the history resent."""
    messages: list[Any] = [
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": "What does README.md say?"},
    ]
    for _ in range(3):
        if stream:
            message = _streamed(client, messages)
        else:
            answer = client.chat.completions.create(model="policy", messages=messages,
                                                    tools=TOOLS)
            message = answer.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        if not message.get("tool_calls"):
            return messages
        for call in message["tool_calls"]:
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": "# Project\nIt answers 42."})
    raise AssertionError("the agent never answered")


def _streamed(client: openai.OpenAI, messages: list[Any]) -> dict[str, Any]:
    text, calls = "", dict[int, dict[str, Any]]()
    for chunk in client.chat.completions.create(model="policy", messages=messages,
                                                tools=TOOLS, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for call in delta.tool_calls or []:
            into = calls.setdefault(call.index, {"id": call.id, "type": "function",
                                                 "function": {"name": "", "arguments": ""}})
            if call.function and call.function.name:
                into["function"]["name"] += call.function.name
            if call.function and call.function.arguments:
                into["function"]["arguments"] += call.function.arguments
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def finish(hub: InProcessHub, rollout_id: str, **body: Any) -> httpx.Response:
    with hub.client() as c:
        return c.post(f"/v1/rollouts/{rollout_id}/finish", json=body)


def test_a_tool_loop_through_the_sdk_becomes_one_trajectory_with_exact_tokens(
    hub: InProcessHub, fake: FakeVllm
) -> None:
    client = openai.OpenAI(base_url=f"{hub.url}/v1/rollouts/run-1", api_key="agent-key",
                           max_retries=0)
    messages = tool_loop(client)
    assert messages[-1]["content"] == "The answer is 42."
    # The upstream got the configured key, never the agent's; the route's fields and model.
    assert {h["authorization"] for h in fake.headers} == {f"Bearer {fake.key}"}
    assert all(b["return_token_ids"] and b["logprobs"] and b["model"] == "fake-policy"
               for b in fake.received)
    assert finish(hub, "run-1", reward=1.5, status="success").status_code == 200

    record = trace(hub, "run-1")
    assert record["format"] == "gateway" and record["env_reward"] == 1.5
    steps = record["trace"]["steps"]
    assert [s["type"] for s in steps] == ["message", "action", "observation", "final"]
    assert steps[1]["tool"] == "read_file" and steps[1]["arguments"] == {"path": "README.md"}
    assert steps[2]["call_id"] == steps[1]["call_id"]
    assert record["trace"]["task"] == "What does README.md say?"
    assert record["trace"]["outcome"]["status"] == "success"
    calls = record["trace"]["metadata"]["gateway"]["calls"]
    assert len(calls) == 2 and all(c["token_ids"] and c["latency_ms"] > 0 for c in calls)
    assert {c["policy_version"] for c in calls} == {"step-7"}
    assert calls[0]["finish_reason"] == "tool_calls" and calls[1]["finish_reason"] == "stop"

    tokens = trace(hub, "run-1", view="tokens")
    assert tokens["exact"] is True
    # The last call's prompt and completion, as the model's template made them.
    assert tokens["tokens"][: len(prompt_ids(messages[:-1]))] == prompt_ids(messages[:-1])
    assert tokens["tokens"][-1] == END
    generated = [i for i, m in enumerate(tokens["masks"]) if m != -100]
    first_prompt = len(prompt_ids(messages[:2]))
    # Both calls' generations are trained on; the tool result and prompts are not.
    assert generated[0] == first_prompt
    assert all(tokens["masks"][i] == tokens["tokens"][i] for i in generated)
    assert len(tokens["logprobs"]) == len(tokens["tokens"])
    assert tokens["logprobs"][generated[0]] == pytest.approx(-0.01 * (first_prompt % 7 + 1))
    assert tokens["logprobs"][0] == 1.0

    # The dashboard shows the calls: latency, finish reason, token ids.
    with hub.client() as c:
        page = c.get("/ui/traces/run-1")
    assert page.status_code == 200
    calls_table = page.text[page.text.index("Model calls"):page.text.index("Tokens view")]
    assert calls_table.count("<td>yes</td>") == 2 and "tool_calls" in calls_table
    assert f"{calls[0]['latency_ms']:.1f}" in calls_table


def test_streamed_calls_pass_chunk_by_chunk_and_are_captured_whole(
    hub: InProcessHub, fake: FakeVllm
) -> None:
    client = openai.OpenAI(base_url=f"{hub.url}/v1", api_key="agent-key", max_retries=0,
                           default_headers={"X-Rollout-Id": "streamed-1"})
    messages = tool_loop(client, stream=True)
    assert messages[-1]["content"] == "The answer is 42."
    assert finish(hub, "streamed-1", reward=2.0).status_code == 200
    record = trace(hub, "streamed-1")
    steps = record["trace"]["steps"]
    assert [s["type"] for s in steps] == ["message", "action", "observation", "final"]
    assert steps[-1]["content"] == "The answer is 42."
    assert all(c["stream"] for c in record["trace"]["metadata"]["gateway"]["calls"])
    tokens = trace(hub, "streamed-1", view="tokens")
    assert tokens["exact"] is True
    # The streamed ids are the same as a plain call's.
    assert tokens["tokens"][: len(prompt_ids(messages[:-1]))] == prompt_ids(messages[:-1])


async def test_the_async_client_streams_before_the_answer_is_complete(
    hub: InProcessHub, fake: FakeVllm
) -> None:
    fake.reply = lambda body: "word " * 40
    fake.chunk_delay = 0.02
    client = openai.AsyncOpenAI(base_url=f"{hub.url}/v1/rollouts/async-1", api_key="k",
                                max_retries=0)
    stream = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "talk"}], stream=True)
    chunks = 0
    async for _ in stream:
        if chunks == 3:
            # The first chunks arrived while the upstream was still writing the answer.
            assert fake.streams_ended == 0
        chunks += 1
    assert fake.streams_ended == 1
    assert chunks > 10
    await client.close()
    finish(hub, "async-1")
    record = trace(hub, "async-1")
    assert record["trace"]["steps"][-1]["content"] == "word " * 40


def test_calls_without_a_rollout_are_stitched_by_conversation(
    hub: InProcessHub, fake: FakeVllm
) -> None:
    with hub.client() as c:
        def ask(messages: list[dict[str, Any]]) -> httpx.Response:
            r = c.post("/v1/chat/completions", json={"model": "policy", "messages": messages,
                                                    "tools": TOOLS})
            assert r.status_code == 200, r.text
            return r
        first = [{"role": "user", "content": "Read README.md"}]
        a = ask(first)
        answer = a.json()["choices"][0]["message"]
        # The SDK's own fields on the resent answer do not break the thread.
        resent = {**answer, "refusal": None, "annotations": []}
        b = ask([*first, resent, {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"],
                                  "content": "It answers 42."}])
        other = ask([{"role": "user", "content": "Something else entirely"}])
    rollout = a.headers["x-rollout-id"]
    assert b.headers["x-rollout-id"] == rollout
    assert other.headers["x-rollout-id"] != rollout
    finish(hub, rollout)
    steps = trace(hub, rollout)["trace"]["steps"]
    assert [s["type"] for s in steps] == ["action", "observation", "final"]


def test_a_conversation_continues_across_the_hubs_of_one_database(
    start_hub: StartHub, trace_server: dict[str, Any], upstream: tuple[FakeVllm, str],
    fake: FakeVllm,
) -> None:
    """Each hub knows the conversations of the calls it committed; a call that
    continues another hub's call, or a longer conversation than this hub saw, is
    stitched by the captures in the database, the longest conversation first."""
    one, two = (gateway_hub(start_hub, trace_server, upstream[1]) for _ in range(2))

    def ask(hub: InProcessHub, messages: list[dict[str, Any]],
            rollout: str | None = None) -> tuple[str, dict[str, Any]]:
        with hub.client() as c:
            r = c.post("/v1/chat/completions", json={"model": "policy", "messages": messages},
                       headers={"X-Rollout-Id": rollout} if rollout else {})
        assert r.status_code == 200, r.text
        return r.headers["x-rollout-id"], r.json()["choices"][0]["message"]

    conversation: list[dict[str, Any]] = [{"role": "user", "content": "Count to three."}]
    first, said = ask(one, conversation)
    conversation += [said, {"role": "user", "content": "Go on."}]
    second, said = ask(two, conversation)  # another hub's call: found in the database
    assert second == first
    conversation += [said, {"role": "user", "content": "Once more."}]
    # A call naming a rollout of its own, on the second hub, continues the
    # conversation; the first hub saw only its shorter beginning.
    named, said = ask(two, conversation, rollout="named-1")
    conversation += [said, {"role": "user", "content": "And again."}]
    assert ask(one, conversation)[0] == named


def test_a_long_agent_conversation_stays_one_rollout(hub: InProcessHub, fake: FakeVllm) -> None:
    """More turns than the prefixes a call looks up (stitching.MAX_PREFIXES), each
    call repeating the whole conversation, none naming its rollout."""
    turns = stitching.MAX_PREFIXES + 4
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You read files."},
                                      {"role": "user", "content": "Read README.md"}]
    rollouts = set()
    with hub.client() as c:
        for turn in range(turns):
            r = c.post("/v1/chat/completions",
                       json={"model": "policy", "messages": messages, "tools": TOOLS})
            assert r.status_code == 200, r.text
            rollouts.add(r.headers["x-rollout-id"])
            said = r.json()["choices"][0]["message"]
            messages.append(said)
            for call in said.get("tool_calls") or []:
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": "line\n" * 200})
            if not said.get("tool_calls"):
                messages.append({"role": "user", "content": f"And after step {turn}?"})
    assert len(rollouts) == 1
    rollout = rollouts.pop()
    finish(hub, rollout)
    steps = trace(hub, rollout)["trace"]["steps"]
    # The system prompt; the tool's call and result; each answer, then the user's turn
    # after it; the last answer.
    assert [s["type"] for s in steps] == ["message", "action", "observation",
                                          *["message", "message"] * (turns - 2), "final"]


def test_a_stored_continuation_keeps_its_digest() -> None:
    """Captures stored by earlier hubs are continued: a digest is the sha256 of the
    JSON array of the messages as the model saw them (role, text, calls, call id)."""
    read = {"id": "c1", "type": "function",
            "function": {"name": "read_file", "arguments": "{}"}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "Read "},
                                     {"type": "text", "text": "README.md"}]},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [read]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    answer = {"role": "assistant", "content": "It says 42."}
    seen = [["user", "Read README.md", [], None],
            ["assistant", "", [["c1", "read_file", "{}"]], None],
            ["tool", "42", [], "c1"],
            ["assistant", "It says 42.", [], None]]
    assert stitching.continuation(messages, answer) == hashlib.sha256(
        json.dumps(seen, separators=(",", ":")).encode()).hexdigest()
    assert stitching.prefixes([*messages, answer]) == [
        stitching.continuation(messages, answer), stitching.continuation(messages[:1],
                                                                         messages[1])]


def test_a_quiet_rollout_closes_by_itself_and_a_late_reward_still_counts(
    start_hub: StartHub, trace_server: dict[str, Any], upstream: tuple[FakeVllm, str],
    fake: FakeVllm,
) -> None:
    hub = gateway_hub(start_hub, trace_server, upstream[1], quiet_seconds=0.3)
    with hub.client() as c:
        r = c.post("/v1/rollouts/quiet-1/chat/completions",
                   json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
    record = trace(hub, "quiet-1")
    assert record["env_reward"] is None
    assert finish(hub, "quiet-1", reward=3.0, metadata={"episode": 4}).status_code == 200

    def rewarded() -> dict[str, Any] | None:
        again = trace(hub, "quiet-1")
        return again if again["env_reward"] == 3.0 else None
    again = wait_until(rewarded, 30, what="the late reward")
    assert again["trace"]["metadata"]["episode"] == 4


def test_upstream_errors_pass_through_as_they_are_and_are_recorded(
    start_hub: StartHub, trace_server: dict[str, Any], upstream: tuple[FakeVllm, str],
    fake: FakeVllm, tmp_path: Path,
) -> None:
    tinker = tmp_path / "tinker.json"
    tinker.write_text(json.dumps({"tinker": {"timeout_seconds": 0.5}}))
    section = {"enabled": True, "upstream": {"base_url": upstream[1], "api_key_env": KEY_ENV}}
    hub = start_hub(trace_server, "--tinker", str(tinker), listen=True, gateway=section)
    client = openai.OpenAI(base_url=f"{hub.url}/v1/rollouts/faults-1", api_key="k",
                           max_retries=0)
    ask = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    fake.faults += [("429", 7), "500", ("hang", 3)]
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(**ask)  # type: ignore[call-overload]
    assert limited.value.response.headers["retry-after"] == "7"
    assert limited.value.body["message"] == "Rate limit reached"  # type: ignore[index]
    with pytest.raises(openai.InternalServerError) as failed:
        client.chat.completions.create(**ask)  # type: ignore[call-overload]
    assert failed.value.status_code == 500
    with hub.client() as c:
        hung = c.post("/v1/rollouts/faults-1/chat/completions", json=ask)
        assert hung.status_code == 504
        assert hung.json()["error"]["field"] == "tinker.timeout_seconds"
        client.chat.completions.create(**ask)  # type: ignore[call-overload]
        assert c.post("/v1/rollouts/faults-1/finish", json={}).status_code == 200
    calls = trace(hub, "faults-1")["trace"]["metadata"]["gateway"]["calls"]
    assert [c["status"] for c in calls] == [429, 500, 504, 200]
    assert calls[0]["error"]["error"]["message"] == "Rate limit reached"


def test_an_upstream_that_is_down_gets_502_and_the_call_is_recorded(
    start_hub: StartHub, trace_server: dict[str, Any], fake: FakeVllm,
) -> None:
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    hub = gateway_hub(start_hub, trace_server, f"http://127.0.0.1:{port}/v1")
    with hub.client() as c:
        r = c.post("/v1/rollouts/down-1/chat/completions",
                   json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
        assert c.post("/v1/rollouts/down-1/finish", json={}).status_code == 200


def test_secrets_are_redacted_and_their_token_ids_withheld(
    hub: InProcessHub, fake: FakeVllm
) -> None:
    secret = "sk-proj-" + "A1b2C3d4" * 6
    with hub.client() as c:
        r = c.post("/v1/rollouts/secret-1/chat/completions", json={
            "model": "policy", "messages": [{"role": "user", "content": f"my key is {secret}"}]})
        assert r.status_code == 200
        finish(hub, "secret-1")
        record = trace(hub, "secret-1", view="original")
        assert secret not in json.dumps(record)
        assert record["trace"]["calls"][0]["tokens_withheld"] == "redacted"
        assert c.get("/v1/traces/secret-1", params={"view": "tokens"}).status_code == 422
    assert fake.key not in hub.log


def test_models_lists_the_upstreams_and_the_finish_of_an_unknown_rollout_is_404(
    hub: InProcessHub, fake: FakeVllm
) -> None:
    client = openai.OpenAI(base_url=f"{hub.url}/v1", api_key="k", max_retries=0)
    assert [m.id for m in client.models.list()] == ["fake-policy"]
    assert finish(hub, "never-called").status_code == 404
    with hub.client() as c:
        bad = c.post("/v1/rollouts/x/finish", json={"reward": "lots"})
        assert bad.status_code == 422


ATROPOS_ENV = """
import asyncio, json, sys
from atroposlib.envs.server_handling.openai_server import OpenAIServer
from atroposlib.envs.server_handling.server_baseline import APIServerConfig

async def main():
    server = OpenAIServer(APIServerConfig(base_url=sys.argv[1], api_key="env-key",
                                          model_name="policy", health_check=False))
    first = "Q: what is 6 x 7?\\nA:"
    one = await server.completion(prompt=first, max_tokens=16)
    two = await server.completion(prompt=first + one.choices[0].text + "\\nQ: and 7 x 6?\\nA:",
                                  max_tokens=16)
    print(json.dumps([one.choices[0].text, two.choices[0].text]))

asyncio.run(main())
"""


@pytest.fixture(scope="session")
def atroposlib_servers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.atroposlib import install_server_classes, installed_for_tests

    return installed_for_tests(install_server_classes, "atroposlib-servers", tmp_path_factory)


def test_atroposlibs_openai_server_calls_completions_and_its_tokens_are_kept(
    hub: InProcessHub, fake: FakeVllm, atroposlib_servers: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", ATROPOS_ENV, f"{hub.url}/v1/rollouts/atropos-1"],
        env={**os.environ, "PYTHONPATH": str(atroposlib_servers)},
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == ["The answer is 42.", "The answer is 42."]
    assert all(b["model"] == "fake-policy" and b["return_token_ids"] for b in fake.received)
    assert finish(hub, "atropos-1", reward=1.0).status_code == 200
    record = trace(hub, "atropos-1")
    assert record["trace"]["task"] == "Q: what is 6 x 7?\nA:"
    assert [s["type"] for s in record["trace"]["steps"]] == ["message", "message", "final"]
    assert record["trace"]["steps"][1]["content"] == "\nQ: and 7 x 6?\nA:"
    tokens = trace(hub, "atropos-1", view="tokens")
    # The end token the model generated is not in the next prompt, which the env sent
    # as text: the chain breaks at the second call, and says so.
    assert tokens["exact"] is False and tokens["broken_at"] == 1
    assert [len(s["token_ids"]) for s in tokens["samples"]] == [18, 18]
    assert sum(m != -100 for m in tokens["masks"]) == 18


@pytest.mark.framework
async def test_the_openai_agents_sdk_runs_its_tool_loop_through_the_gateway(
    hub: InProcessHub, fake: FakeVllm
) -> None:
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # its traces would go to OpenAI's servers
    read: list[str] = []

    @function_tool
    def read_file(path: str) -> str:
        """Read a file."""
        read.append(path)
        return "# Project\nIt answers 42."

    client = openai.AsyncOpenAI(base_url=f"{hub.url}/v1/rollouts/agents-1", api_key="k",
                                max_retries=0)
    agent = Agent(name="reader", instructions="Answer from the files.", tools=[read_file],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    result = await Runner.run(agent, "What does README.md say?")
    assert result.final_output == "The answer is 42."
    assert read == ["README.md"]
    await client.close()
    finish(hub, "agents-1", reward=1.0)
    record = await wait_until_async(lambda: _stored(hub, "agents-1"), 30, what="agents-1")
    steps = record["trace"]["steps"]
    assert [s["type"] for s in steps] == ["message", "action", "observation", "final"]
    assert steps[0]["content"] == "Answer from the files."
    assert steps[2]["content"] == "# Project\nIt answers 42."
    async with hub.async_client() as c:
        tokens = (await c.get("/v1/traces/agents-1", params={"view": "tokens"})).json()
    assert tokens["exact"] is True


async def _stored(hub: InProcessHub, trace_id: str) -> dict[str, Any] | None:
    async with hub.async_client() as c:
        r = await c.get(f"/v1/traces/{trace_id}")
    return dict(r.json()) if r.status_code == 200 else None


def test_while_the_hub_cannot_store_calls_get_503_before_the_upstream_is_paid(
    start_hub: StartHub, tmp_path: Path, upstream: tuple[FakeVllm, str], fake: FakeVllm,
) -> None:
    import sqlite3

    db = tmp_path / "locked.db"
    hub = start_hub({"storage_backend": "sqlite", "db_path": str(db)}, listen=True,
                    gateway={"enabled": True,
                             "upstream": {"base_url": upstream[1], "api_key_env": KEY_ENV}},
                    limits={"max_write_wait_seconds": 1})
    ask = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    lock = sqlite3.connect(db, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")  # another process holds the database: no write commits
    try:
        with hub.client() as c:
            first = c.post("/v1/rollouts/locked-1/chat/completions", json=ask)
            # Its answer came, but its capture could not be stored: the agent never
            # gets an answer the hub did not keep.
            assert first.status_code == 503 and "retry-after" in first.headers
            paid = len(fake.received)
            second = c.post("/v1/rollouts/locked-1/chat/completions", json=ask)
            assert second.status_code == 503 and "retry-after" in second.headers
            assert "not sent upstream" in second.json()["error"]["message"]
            assert len(fake.received) == paid
    finally:
        lock.execute("ROLLBACK")
        lock.close()

    def answered() -> bool:
        with hub.client() as c:
            return c.post("/v1/rollouts/locked-1/chat/completions", json=ask).status_code == 200
    wait_until(answered, 60, what="calls answered again once the database works")


def test_with_auth_on_agents_need_a_gateway_key(
    start_hub: StartHub, trace_server: dict[str, Any], upstream: tuple[FakeVllm, str],
    fake: FakeVllm,
) -> None:
    from tests.support.databases import make_api_key

    hub = start_hub(trace_server, listen=True, auth={"enabled": True}, gateway={
        "enabled": True, "upstream": {"base_url": upstream[1], "api_key_env": KEY_ENV}})
    gateway_key = make_api_key(trace_server, "gateway", name="agents")
    ingest_key = make_api_key(trace_server, "ingest", name="collector")
    ask = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    with hub.client() as c:
        assert c.post("/v1/chat/completions", json=ask).status_code == 401
        refused = c.post("/v1/chat/completions", json=ask,
                         headers={"Authorization": f"Bearer {ingest_key}"})
        assert refused.status_code == 403
        assert not fake.received  # nothing paid for a refused agent
    client = openai.OpenAI(base_url=f"{hub.url}/v1", api_key=gateway_key, max_retries=0)
    assert client.chat.completions.create(**ask).choices[0].message.content  # type: ignore[call-overload]
    # The hub's key went no further: the upstream saw only its own.
    assert fake.headers[-1]["authorization"] == f"Bearer {fake.key}"


def test_an_agent_that_leaves_mid_stream_leaves_its_call_captured_and_marked(
    hub: InProcessHub, fake: FakeVllm
) -> None:
    fake.reply = lambda body: "word " * 200
    fake.chunk_delay = 0.02
    ask = {"model": "policy", "messages": [{"role": "user", "content": "talk"}], "stream": True}
    with httpx.Client(timeout=30) as c, c.stream(
            "POST", f"{hub.url}/v1/rollouts/left-1/chat/completions", json=ask) as answer:
        assert answer.status_code == 200
        received = 0
        for received, _ in enumerate(answer.iter_raw(), 1):
            if received == 3:
                break  # the agent goes: its connection closes, the answer unread
    assert received == 3 and fake.streams_ended == 0
    # A finish is refused until the rollout has a captured call.
    wait_until(lambda: finish(hub, "left-1").status_code == 200, 30,
               what="the call captured after its agent left")
    [call] = trace(hub, "left-1")["trace"]["metadata"]["gateway"]["calls"]
    assert call["disconnected"] is True and call["stream"] is True and call["status"] == 200


TRAINER = {"wandb_group": "g", "wandb_project": "p", "batch_size": 2, "max_token_len": 512,
           "checkpoint_dir": "c", "save_checkpoint_interval": 10, "starting_step": 12,
           "num_steps": 100}


def test_without_a_route_version_calls_are_served_by_the_atropos_trainers_step(
    start_hub: StartHub, trace_server: dict[str, Any], upstream: tuple[FakeVllm, str],
    fake: FakeVllm,
) -> None:
    hub = gateway_hub(start_hub, trace_server, upstream[1], routes=[])
    ask = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    with hub.client() as c:
        assert c.post("/register", json=TRAINER).status_code == 200
        assert c.post("/v1/rollouts/step-1/chat/completions", json=ask).status_code == 200
    assert finish(hub, "step-1").status_code == 200
    calls = trace(hub, "step-1")["trace"]["metadata"]["gateway"]["calls"]
    assert [c["policy_version"] for c in calls] == ["12"]


def test_the_upstream_is_the_tinker_sections_unless_named_and_routes_drop_fields(
    start_hub: StartHub, trace_server: dict[str, Any], upstream: tuple[FakeVllm, str],
    fake: FakeVllm, tmp_path: Path,
) -> None:
    """The seeds' model channel (tinker.json's base_url and api_key_env) is where calls
    go when the gateway names no upstream; a route drops what the upstream refuses."""
    tinker = tmp_path / "tinker.json"
    tinker.write_text(json.dumps({"tinker": {"base_url": upstream[1], "api_key_env": KEY_ENV}}))
    hub = start_hub(trace_server, "--tinker", str(tinker), listen=True, gateway={
        "enabled": True, "routes": [{"model": "policy", "drop": ["temperature"]}]})
    with hub.client() as c:
        r = c.post("/v1/rollouts/channel-1/chat/completions", json={
            "model": "policy", "temperature": 0.7,
            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    assert fake.headers[-1]["authorization"] == f"Bearer {fake.key}"
    assert fake.received[-1]["model"] == "policy" and "temperature" not in fake.received[-1]


def test_the_responses_api_is_forwarded_and_its_conversation_captured(
    hub: InProcessHub, fake: FakeVllm
) -> None:
    client = openai.OpenAI(base_url=f"{hub.url}/v1/rollouts/responses-1", api_key="k",
                           max_retries=0)
    first = client.responses.create(model="policy", instructions="Be brief.",
                                    input="What is 6 x 7?")
    assert first.output_text == "The answer is 42."
    assert fake.received[-1]["model"] == "fake-policy"  # the route applies here too
    # The upstream keeps the conversation: the next call sends only what comes next.
    client.responses.create(model="policy", previous_response_id=first.id,
                            input=[{"role": "user", "content": [
                                {"type": "input_text", "text": "And 7 x 6?"}]}])
    assert finish(hub, "responses-1", reward=1.0).status_code == 200
    record = trace(hub, "responses-1")
    assert record["trace"]["task"] == "What is 6 x 7?"
    assert [s.get("content") for s in record["trace"]["steps"]] == [
        "Be brief.", "The answer is 42.", "And 7 x 6?", "The answer is 42."]
    calls = record["trace"]["metadata"]["gateway"]["calls"]
    assert [(c["kind"], c["status"]) for c in calls] == [("responses", 200)] * 2


def test_a_streamed_responses_call_reaches_the_agent_and_is_captured_whole(
    hub: InProcessHub, fake: FakeVllm
) -> None:
    with openai.OpenAI(base_url=f"{hub.url}/v1/rollouts/responses-stream", api_key="k",
                       max_retries=0) as client, client.responses.stream(
            model="policy", instructions="Be brief.", input="What is 6 x 7?") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "The answer is 42."
    assert fake.received[-1]["stream"] is True
    assert finish(hub, "responses-stream", reward=1.0).status_code == 200
    record = trace(hub, "responses-stream")
    assert record["trace"]["task"] == "What is 6 x 7?"
    assert [s.get("content") for s in record["trace"]["steps"]] == [
        "Be brief.", "The answer is 42."]
    [call] = trace(hub, "responses-stream", view="original")["trace"]["calls"]
    assert (call["kind"], call["stream"], call["status"]) == ("responses", True, 200)
    assert call["response"]["status"] == "completed"
    assert call["usage"] == {"input_tokens": 3, "output_tokens": 17, "total_tokens": 20}


def test_responses_function_calls_are_the_agents_actions_and_an_image_adds_no_step() -> None:
    from app.formats import gateway

    def call(request: dict[str, Any], output: list[Any]) -> dict[str, Any]:
        return {"kind": "responses", "request": request, "status": 200,
                "response": {"status": "completed", "output": output}}

    asked = [{"role": "user", "content": "Read README.md"}]
    called = {"type": "function_call", "call_id": "c1", "name": "read_file",
              "arguments": '{"path": "README.md"}'}
    result = {"type": "function_call_output", "call_id": "c1", "output": "It answers 42."}
    said = {"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": "The answer is 42."}]}
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}
    thought = {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}
    trace = gateway.parse(gateway.document("r-1", [
        call({"input": asked, "tools": TOOLS}, [called]),
        call({"input": [*asked, called, result]}, [thought, said]),
        call({"input": [*asked, called, result, thought, said, image]}, [said]),
    ], None))
    assert [s.type for s in trace.steps] == ["action", "observation", "final"]
    assert trace.steps[0].tool == "read_file" and trace.steps[1].call_id == "c1"
    assert trace.steps[2].content == "The answer is 42."
