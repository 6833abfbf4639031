"""The one client for the model endpoint: an OpenAI-compatible chat completions API
named by tinker.json. Every model call in the hub goes through `chat()`.

Errors, translated from httpx and HTTP statuses here and nowhere else. Each message
says what to do about it; none carries the key (the variable is named, its value never).

LLMError
 ├── KeyMissing           the variable named by api_key_env is unset or empty
 ├── KeyRejected          401/403: the endpoint refused the key
 ├── WrongURL             404: nothing answers at the URL used (or not for that model)
 ├── ProxyFailed          the proxy that HTTP(S)_PROXY / ALL_PROXY routes through failed
 ├── BadResponse          a 200 whose body has no `choices`
 ├── RequestRejected      another 4xx: the endpoint refused this request
 └── EndpointUnavailable  429, 5xx, timeouts, connection failures: after the retries
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import os
import random
import re
import time
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from app.config import TinkerConfig

__all__ = [
    "BadResponse",
    "ChatResult",
    "EndpointUnavailable",
    "KeyMissing",
    "KeyRejected",
    "LLMError",
    "ProxyFailed",
    "RequestRejected",
    "WrongURL",
    "api_base_url",
    "chat",
    "chat_url",
]

log = logging.getLogger(__name__)

# The last path segment of a base URL that already names an API version: v1, v2, v4,
# v1beta, v1alpha2 ...
_VERSION = re.compile(r"v\d+(?:(?:alpha|beta)\d*)?", re.IGNORECASE)
_BODY_SHOWN = 200
# Added to the exponential backoff, as a fraction of it, so that workers that failed
# together do not retry together (Hermes' jittered_backoff uses the same ratio).
_JITTER_RATIO = 0.5


class LLMError(Exception):
    """A model call that failed; `url` is the URL used, `status` the HTTP status if any."""

    def __init__(self, message: str, *, url: str, status: int | None = None):
        super().__init__(message)
        self.url = _shown(url)
        self.status = status


class KeyMissing(LLMError):
    pass


class KeyRejected(LLMError):
    pass


class WrongURL(LLMError):
    pass


class ProxyFailed(LLMError):
    pass


class BadResponse(LLMError):
    pass


class RequestRejected(LLMError):
    pass


class EndpointUnavailable(LLMError):
    pass


@dataclass(frozen=True)
class ChatResult:
    text: str
    prompt_tokens: int | None
    completion_tokens: int | None
    status: int
    url: str
    model: str
    attempts: int


def chat_url(base_url: str) -> str:
    """The chat completions URL for `base_url`.

    A base ending at a version segment (`.../v1`, `.../v4`) gets `/chat/completions`,
    as the OpenAI SDK does; a provider root (`https://taotoken.net/api`) gets
    `/v1/chat/completions`. A URL that already ends in `/chat/completions` is used as
    it is, for providers whose path fits neither shape.
    """
    base = base_url.strip().rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    last = urlsplit(base).path.rsplit("/", 1)[-1]
    return f"{base}/chat/completions" if _VERSION.fullmatch(last) else f"{base}/v1/chat/completions"


def api_base_url(base_url: str) -> str:
    """The OpenAI-style base URL (`.../v1`) for `base_url`, normalised as `chat_url`
    does: what an OpenAI SDK client takes as OPENAI_BASE_URL."""
    return chat_url(base_url).removesuffix("/chat/completions")


async def chat(
    client: httpx.AsyncClient,
    tinker: TinkerConfig,
    messages: list[dict[str, Any]],
    *,
    max_tokens: int = 1024,
    temperature: float = 0.3,
) -> ChatResult:
    """One chat completion from the endpoint tinker.json names, with tinker.model_id.

    Retries 429, 5xx, 408, timeouts and connection failures up to `max_retries` times,
    waiting a jittered exponential backoff, or longer when the endpoint says so with
    Retry-After. Anything else fails at once with an `LLMError` that says what to fix.
    """
    url = chat_url(tinker.base_url)
    key = tinker.api_key()
    if not key:
        raise KeyMissing(
            f"the environment variable {tinker.api_key_env} (named by tinker.api_key_env) "
            f"is not set or empty: export it with the key for {_shown(url)}",
            url=url,
        )
    call = _Call(client, tinker, url, key)
    body = {
        "model": tinker.model_id,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
    }
    attempts = tinker.max_retries + 1
    for attempt in range(1, attempts + 1):
        outcome = await call.attempt(body, attempt)
        if isinstance(outcome, ChatResult):
            return outcome
        retry = outcome
        if attempt == attempts:
            break
        delay = _delay(attempt, retry.after, tinker)
        if delay is None:
            raise call.unavailable(
                f"{retry.reason}, and it asks to wait {retry.after or 0:.0f} s, longer than "
                f"tinker.retry_max_delay_seconds ({tinker.retry_max_delay_seconds:g} s)",
                attempt,
                retry.status,
            )
        log.warning(
            "model endpoint %s: %s; retry %d/%d in %.2f s",
            _shown(url),
            retry.reason,
            attempt,
            tinker.max_retries,
            delay,
        )
        await asyncio.sleep(delay)
    raise call.unavailable(retry.reason, attempts, retry.status)


@dataclass(frozen=True)
class _Retry:
    """A failed attempt worth repeating: why, and how long the endpoint asked to wait."""

    reason: str
    status: int | None = None
    after: float | None = None


class _Call:
    """One chat() call: sends attempts and turns each failure into an LLMError or _Retry."""

    def __init__(self, client: httpx.AsyncClient, tinker: TinkerConfig, url: str, key: str):
        self.client = client
        self.tinker = tinker
        self.url = url
        self.key = key
        self.proxy_var = _proxy_var(client, url)

    async def attempt(self, body: dict[str, Any], attempt: int) -> ChatResult | _Retry:
        try:
            response = await self.client.post(
                self.url,
                json=body,
                headers={"Authorization": f"Bearer {self.key}"},
                timeout=self.tinker.timeout_seconds,
            )
        except httpx.ProxyError as exc:
            raise self._proxy_failed(_transport_detail(exc)) from None
        except httpx.TimeoutException:
            return _Retry(f"no answer within {self.tinker.timeout_seconds:g} s (timeout)")
        except httpx.TransportError as exc:
            # Behind a proxy the connection is to the proxy, so a refused connection is its.
            if self.proxy_var and isinstance(exc, httpx.ConnectError):
                raise self._proxy_failed(_transport_detail(exc)) from None
            return _Retry(f"cannot reach it ({_transport_detail(exc)})")
        return self._answer(response, attempt)

    def _answer(self, response: httpx.Response, attempt: int) -> ChatResult | _Retry:
        status = response.status_code
        if status == 200:
            return self._result(response, attempt)
        if status in (401, 403):
            raise KeyRejected(
                f"the model endpoint rejected the key (HTTP {status}) at {_shown(self.url)}: "
                f"check that the environment variable {self.tinker.api_key_env} (named by "
                f"tinker.api_key_env) holds a valid key for this endpoint",
                url=self.url,
                status=status,
            )
        if status == 404:
            raise WrongURL(
                f"nothing answers at {_shown(self.url)} (HTTP 404) for model "
                f"{self.tinker.model_id}: the URL is wrong; check tinker.base_url "
                f"({_shown(self.tinker.base_url.strip())}), which may end at the provider "
                f"root (.../api) or at a version (.../v1), or the model id. "
                f"Body: {self._start(response)}",
                url=self.url,
                status=status,
            )
        if status == 407:
            raise self._proxy_failed("HTTP 407 Proxy Authentication Required")
        if status in (408, 429) or status >= 500:
            reason = f"HTTP {status}"
            if self.proxy_var and status in (502, 503, 504):
                reason += f" (through the proxy named by {self.proxy_var})"
            return _Retry(reason, status, _retry_after(response))
        raise RequestRejected(
            f"the model endpoint refused the request (HTTP {status}) at {_shown(self.url)} "
            f"for model {self.tinker.model_id}: {self._start(response)}",
            url=self.url,
            status=status,
        )

    def _result(self, response: httpx.Response, attempt: int) -> ChatResult:
        try:
            data = response.json()
            text = data["choices"][0]["message"].get("content") or ""
            usage = data.get("usage") or {}
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise BadResponse(
                f"the model endpoint answered HTTP 200 without `choices` for model "
                f"{self.tinker.model_id} at {_shown(self.url)}; the body starts: "
                f"{self._start(response)}",
                url=self.url,
                status=200,
            ) from None
        return ChatResult(
            text=text,
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            status=200,
            url=self.url,
            model=data.get("model") or self.tinker.model_id,
            attempts=attempt,
        )

    def _proxy_failed(self, detail: str) -> ProxyFailed:
        var = self.proxy_var or "HTTPS_PROXY/HTTP_PROXY/ALL_PROXY"
        return ProxyFailed(
            f"the request to {_shown(self.url)} went through the proxy named by {var}, "
            f"and the proxy failed ({detail}): fix or unset {var}, or add the host to NO_PROXY",
            url=self.url,
        )

    def unavailable(self, reason: str, attempts: int, status: int | None) -> EndpointUnavailable:
        return EndpointUnavailable(
            f"the model endpoint at {_shown(self.url)} is unavailable after {attempts} "
            f"attempt(s): {reason}; try again later or raise tinker.max_retries",
            url=self.url,
            status=status,
        )

    def _start(self, response: httpx.Response) -> str:
        # Some providers echo the key they refused; it must not reach a log.
        return repr(response.text.replace(self.key, "***")[:_BODY_SHOWN])


def _delay(attempt: int, retry_after: float | None, tinker: TinkerConfig) -> float | None:
    """Seconds before the next attempt; None when Retry-After asks for more than we wait."""
    if retry_after is not None and retry_after > tinker.retry_max_delay_seconds:
        return None
    backoff: float = min(
        tinker.retry_base_delay_seconds * 2.0 ** (attempt - 1), tinker.retry_max_delay_seconds
    )
    backoff += random.uniform(0, _JITTER_RATIO * backoff)
    return max(backoff, retry_after or 0.0)


def _retry_after(response: httpx.Response) -> float | None:
    """Retry-After as seconds: a number (fractions accepted) or an HTTP date."""
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


def _proxy_var(client: httpx.AsyncClient, url: str) -> str | None:
    """The environment variable (as spelled there) whose proxy a request to `url` uses.

    Mirrors httpx: with trust_env it reads the *_proxy variables through urllib, where
    the lowercase spelling wins, ALL_PROXY covers every scheme, and NO_PROXY exempts."""
    if not client.trust_env:
        return None
    parts = urlsplit(url)
    if urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    for name in (f"{parts.scheme}_proxy", "all_proxy"):
        for var in (name, name.upper()):
            if os.environ.get(var):
                return var
    return None


def _transport_detail(exc: httpx.TransportError) -> str:
    # The text can name a proxy URL, and proxy URLs can carry user:password.
    text = re.sub(r"//[^/@\s]+@", "//***@", str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _shown(url: str) -> str:
    """The URL without user info or query, where a credential could hide."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
