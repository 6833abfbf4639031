from __future__ import annotations

import logging
import socket
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from app.config import TinkerConfig
from app.llm import (
    BadResponse,
    EndpointUnavailable,
    KeyMissing,
    KeyRejected,
    LLMError,
    ProxyFailed,
    RequestRejected,
    WrongURL,
    chat,
    chat_url,
)
from tests.support.fakes.model_server import FakeModel, Fault

KEY = FakeModel.key
KEY_ENV = "FAKE_MODEL_KEY"
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture
def fake(fake_model: FakeModel, monkeypatch: pytest.MonkeyPatch) -> FakeModel:
    # Surrounding whitespace, as a key pasted into a shell profile often has.
    monkeypatch.setenv(KEY_ENV, f"  {KEY}\n")
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(var, raising=False)
    return fake_model


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as c:
        yield c


RETRY = {"max_attempts": 3, "base_seconds": 0.001, "max_seconds": 1.0}


def tinker(base_url: str, **overrides: object) -> TinkerConfig:
    settings: dict[str, object] = {
        "base_url": base_url,
        "api_key_env": KEY_ENV,
        "model_id": "fake/model-1",
        "retry": RETRY,
        "timeout_seconds": 2.0,
    }
    return TinkerConfig.model_validate(settings | overrides)


@pytest.mark.parametrize(
    ("base", "url"),
    [
        ("https://taotoken.net/api", "https://taotoken.net/api/v1/chat/completions"),
        ("https://taotoken.net/api/", "https://taotoken.net/api/v1/chat/completions"),
        ("  https://api.openai.com/v1/ \n", "https://api.openai.com/v1/chat/completions"),
        ("https://openrouter.ai/api/v1", "https://openrouter.ai/api/v1/chat/completions"),
        (
            "https://open.bigmodel.cn/api/coding/paas/v4",
            "https://open.bigmodel.cn/api/coding/paas/v4/chat/completions",
        ),
        ("http://127.0.0.1:1234/v1", "http://127.0.0.1:1234/v1/chat/completions"),
        ("http://127.0.0.1:1234", "http://127.0.0.1:1234/v1/chat/completions"),
        ("https://x.dev/v1beta", "https://x.dev/v1beta/chat/completions"),
        ("https://x.dev/v1/chat/completions/", "https://x.dev/v1/chat/completions"),
    ],
)
def test_chat_url(base: str, url: str) -> None:
    assert chat_url(base) == url


async def test_request_shape_and_bearer_key(
    fake: FakeModel, model_root: str, client: httpx.AsyncClient
) -> None:
    result = await chat(client, tinker(f"{model_root}/v1/"), MESSAGES, max_tokens=77, temperature=0.2)
    assert result.text.startswith("[CONTEXT SUMMARY]:")
    assert (result.status, result.attempts, result.prompt_tokens, result.completion_tokens) == (
        200,
        1,
        100,
        20,
    )
    assert result.url == f"{model_root}/v1/chat/completions"
    [request] = fake.received
    assert request.path == "/v1/chat/completions"
    assert request.headers["authorization"] == f"Bearer {KEY}"  # stripped
    assert request.body == {
        "model": "fake/model-1",
        "messages": MESSAGES,
        "max_tokens": 77,
        "temperature": 0.2,
    }


async def test_provider_root_gets_v1(fake: FakeModel, model_root: str, client: httpx.AsyncClient) -> None:
    fake.prefix = "/api/v1"
    result = await chat(client, tinker(f"{model_root}/api"), MESSAGES)
    assert result.url == f"{model_root}/api/v1/chat/completions"
    assert fake.received[0].path == "/api/v1/chat/completions"


async def test_missing_key_names_the_variable(
    fake: FakeModel, model_root: str, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "   ")
    with pytest.raises(KeyMissing, match=KEY_ENV):
        await chat(client, tinker(model_root), MESSAGES)
    assert fake.received == []


@pytest.mark.parametrize("status", ["401", "403"])
async def test_rejected_key_names_the_variable_not_the_value(
    fake: FakeModel, model_root: str, client: httpx.AsyncClient, status: str
) -> None:
    fake.faults.append(status)
    with pytest.raises(KeyRejected) as caught:
        await chat(client, tinker(model_root), MESSAGES)
    assert KEY_ENV in str(caught.value) and f"HTTP {status}" in str(caught.value)
    assert len(fake.received) == 1  # never retried


async def test_wrong_key_is_rejected(
    fake: FakeModel, model_root: str, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-wrong-secret")
    with pytest.raises(KeyRejected) as caught:
        await chat(client, tinker(model_root), MESSAGES)
    assert "sk-wrong-secret" not in str(caught.value)


async def test_404_names_the_url_used(
    fake: FakeModel, model_root: str, client: httpx.AsyncClient
) -> None:
    with pytest.raises(WrongURL) as caught:
        await chat(client, tinker(f"{model_root}/api"), MESSAGES)  # the fake serves /v1 only
    assert f"{model_root}/api/v1/chat/completions" in str(caught.value)
    assert caught.value.status == 404 and len(fake.received) == 1


async def test_retry_honours_retry_after(
    fake: FakeModel, model_root: str, client: httpx.AsyncClient
) -> None:
    fake.faults.append(("429", 0.3))
    started = time.monotonic()
    result = await chat(client, tinker(model_root), MESSAGES)
    # The backoff alone would be ~1 ms; the endpoint asked for 0.3 s.
    assert time.monotonic() - started >= 0.3
    assert result.attempts == 2 and len(fake.received) == 2


async def test_retry_after_beyond_our_patience_gives_up(
    fake: FakeModel, model_root: str, client: httpx.AsyncClient
) -> None:
    fake.faults.append(("429", 120))
    with pytest.raises(EndpointUnavailable, match="asks to wait 120 s"):
        await chat(client, tinker(model_root), MESSAGES)
    assert len(fake.received) == 1


async def test_5xx_retried_then_succeeds(
    fake: FakeModel, model_root: str, client: httpx.AsyncClient
) -> None:
    fake.faults.extend(["500", "502"])
    result = await chat(client, tinker(model_root), MESSAGES)
    assert result.attempts == 3


async def test_5xx_exhausts_retries(fake: FakeModel, model_root: str, client: httpx.AsyncClient) -> None:
    fake.faults.extend(["500"] * 5)
    with pytest.raises(EndpointUnavailable, match="after 3 attempt") as caught:
        await chat(client, tinker(model_root), MESSAGES)
    assert caught.value.status == 500 and len(fake.received) == 3


async def test_timeouts_are_retried(fake: FakeModel, model_root: str, client: httpx.AsyncClient) -> None:
    fake.faults.extend([("slow", 1.0)] * 2)
    with pytest.raises(EndpointUnavailable, match="timeout"):
        await chat(client, tinker(model_root, timeout_seconds=0.2, retry=RETRY | {"max_attempts": 2}), MESSAGES)
    assert len(fake.received) == 2


async def test_200_without_choices_names_model_and_body(
    fake: FakeModel, model_root: str, client: httpx.AsyncClient
) -> None:
    fake.faults.append("no_choices")
    with pytest.raises(BadResponse) as caught:
        await chat(client, tinker(model_root), MESSAGES)
    message = str(caught.value)
    assert "fake/model-1" in message and "upstream hiccup" in message
    assert len(fake.received) == 1


async def test_other_4xx_shows_the_body_without_the_key(
    fake: FakeModel, model_root: str, client: httpx.AsyncClient
) -> None:
    fake.faults.append("echo_key")
    with pytest.raises(RequestRejected) as caught:
        await chat(client, tinker(model_root), MESSAGES)
    assert "HTTP 400" in str(caught.value) and "***" in str(caught.value)


@pytest.mark.parametrize("var", ["http_proxy", "HTTP_PROXY", "ALL_PROXY"])
async def test_proxy_failure_names_the_variable(
    fake: FakeModel, model_root: str, monkeypatch: pytest.MonkeyPatch, var: str
) -> None:
    monkeypatch.setenv(var, f"http://user:proxy-secret@127.0.0.1:{_closed_port()}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    async with httpx.AsyncClient() as proxied:  # reads the proxy variables when built
        with pytest.raises(ProxyFailed) as caught:
            await chat(proxied, tinker(model_root), MESSAGES)
    assert var in str(caught.value) and "proxy-secret" not in str(caught.value)
    assert fake.received == []


async def test_no_secret_in_any_error_or_log(
    fake: FakeModel, model_root: str, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    errors: list[LLMError] = []
    faults: list[Fault] = ["401", "404", "no_choices", "echo_key", ("429", 0.01)]
    for fault in faults:
        fake.faults.clear()
        fake.faults.extend([fault] * 4)
        try:
            await chat(client, tinker(model_root), MESSAGES)
        except LLMError as exc:
            errors.append(exc)
    assert len(errors) == 5
    for text in [str(e) for e in errors] + [caplog.text]:
        assert KEY not in text


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
