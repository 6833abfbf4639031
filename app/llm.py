"""The one client for the model endpoint: an OpenAI-compatible API named by
tinker.json. Every model call in the hub goes through `chat()`; the other resources of
the same API (files, fine-tuning jobs) through `request()`, with the same key handling,
retries and errors.

Errors, translated from httpx and HTTP statuses here and nowhere else. Each message
says what to do about it; none carries the key (the variable is named, its value never).

LLMError (an app.errors.ServiceError)
 ├── KeyMissing           the variable named by api_key_env is unset or empty
 ├── KeyRejected          401/403: the endpoint refused the key
 ├── WrongURL             404: nothing answers at the URL used (or not for that model)
 ├── ProxyFailed          the proxy that HTTP(S)_PROXY / ALL_PROXY routes through failed
 ├── BadResponse          a 200 whose body has no `choices` (or is not JSON)
 ├── RequestRejected      another 4xx: the endpoint refused this request
 └── EndpointUnavailable  429, 5xx, timeouts, connection failures: after the retries
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import os
import re
import time
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from app.config import CompressionConfig, RetryPolicy, TinkerConfig
from app.errors import ServiceError
from app.outage import Outage

if TYPE_CHECKING:
    # Imported where a call is made (`_Call.attempt`): the hub imports this module
    # (its errors, model_outage) before it serves, and needs no HTTP client then.
    import httpx

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
    "api_url",
    "chat",
    "chat_url",
    "proxy_var",
    "request",
    "shown",
]

log = logging.getLogger(__name__)

# The last path segment of a base URL that already names an API version: v1, v2, v4,
# v1beta, v1alpha2 ...
_VERSION = re.compile(r"v\d+(?:(?:alpha|beta)\d*)?", re.IGNORECASE)
_BODY_SHOWN = 200


class LLMError(ServiceError):
    """A model call that failed; `url` is the URL used, `status` the HTTP status if any."""

    def __init__(self, message: str, *, url: str, status: int | None = None):
        super().__init__(message)
        self.url = shown(url)
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

    @property
    def total_tokens(self) -> int:
        return (self.prompt_tokens or 0) + (self.completion_tokens or 0)


def api_base_url(base_url: str) -> str:
    """The OpenAI-style base URL for `base_url`: what an OpenAI SDK client takes as
    OPENAI_BASE_URL, and what every resource (`chat/completions`, `files`, ...) hangs
    from.

    A base ending at a version segment (`.../v1`, `.../v4`) is used as it is, as the
    OpenAI SDK does; a provider root (`https://taotoken.net/api`) gets `/v1`. A URL
    that already ends in `/chat/completions` is its base plus that, for providers whose
    path fits neither shape.
    """
    base = base_url.strip().rstrip("/")
    if base.endswith("/chat/completions"):
        return base.removesuffix("/chat/completions")
    last = urlsplit(base).path.rsplit("/", 1)[-1]
    return base if _VERSION.fullmatch(last) else f"{base}/v1"


def api_url(base_url: str, resource: str) -> str:
    """The URL of `resource` (`chat/completions`, `files`, `fine_tuning/jobs/ID`)."""
    return f"{api_base_url(base_url)}/{resource}"


def chat_url(base_url: str) -> str:
    """The chat completions URL for `base_url` (see `api_base_url`)."""
    return api_url(base_url, "chat/completions")


async def chat(
    client: httpx.AsyncClient,
    tinker: TinkerConfig,
    messages: list[dict[str, Any]],
    *,
    max_tokens: int = 1024,
    temperature: float = 0.3,
    model: str | None = None,
) -> ChatResult:
    """One chat completion from the endpoint tinker.json names, with tinker.model_id
    (or `model`: a model fine-tuned there).

    Retries 429, 5xx, 408, timeouts and connection failures as tinker.retry says (the
    stages' RetryPolicy), or waits longer when the endpoint says so with Retry-After.
    Anything else fails at once with an `LLMError` that says what to fix.
    """
    call = _Call(client, tinker, chat_url(tinker.base_url), model or tinker.model_id)
    body = {
        "model": call.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
    }
    response, attempt = await call.send("POST", {"json": body})
    return call.chat_result(response, attempt)


async def request(
    client: httpx.AsyncClient,
    tinker: TinkerConfig,
    method: str,
    resource: str,
    *,
    model: str | None = None,
    **send: Any,
) -> dict[str, Any]:
    """One call to another resource of the same API (`files`, `fine_tuning/jobs`),
    with chat()'s key, retries and errors; `send` goes to httpx (json, files, data,
    params, headers). Returns the JSON body of a 2xx answer."""
    call = _Call(client, tinker, api_url(tinker.base_url, resource), model or tinker.model_id)
    response, _ = await call.send(method, send)
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise BadResponse(
            f"{method} {shown(call.url)} answered HTTP {response.status_code} without a "
            f"JSON object; the body starts: {call.start(response)}",
            url=call.url,
            status=response.status_code,
        )
    return body


@dataclass(frozen=True)
class _Retry:
    """A failed attempt worth repeating: why, and how long the endpoint asked to wait."""

    reason: str
    status: int | None = None
    after: float | None = None


class _Call:
    """One chat() or request() call: sends attempts and turns each failure into an
    LLMError or a _Retry."""

    def __init__(self, client: httpx.AsyncClient, tinker: TinkerConfig, url: str, model: str):
        key = tinker.api_key()
        if not key:
            raise KeyMissing(
                f"the environment variable {tinker.api_key_env} (named by tinker.api_key_env) "
                f"is not set or empty: export it with the key for {shown(url)}",
                url=url,
            )
        self.client = client
        self.tinker = tinker
        self.url = url
        self.model = model
        self.key = key
        self.proxy_var = _proxy_var(client, url)

    async def send(self, method: str, send: dict[str, Any]) -> tuple[httpx.Response, int]:
        """The 2xx response and the attempt that got it, after the retries."""
        policy = self.tinker.retry
        attempts = policy.max_attempts
        for attempt in range(1, attempts + 1):
            outcome = await self.attempt(method, send)
            if not isinstance(outcome, _Retry):
                return outcome, attempt
            retry = outcome
            if attempt == attempts:
                break
            delay = _delay(attempt, retry.after, policy)
            if delay is None:
                raise self.unavailable(
                    f"{retry.reason}, and it asks to wait {retry.after or 0:.0f} s, longer "
                    f"than tinker.retry.max_seconds ({policy.max_seconds:g} s)",
                    attempt,
                    retry.status,
                )
            log.warning(
                "model endpoint %s: %s; retry %d/%d in %.2f s",
                shown(self.url),
                retry.reason,
                attempt,
                attempts - 1,
                delay,
            )
            await asyncio.sleep(delay)
        raise self.unavailable(retry.reason, attempts, retry.status)

    async def attempt(self, method: str, send: dict[str, Any]) -> httpx.Response | _Retry:
        import httpx

        headers = {**send.get("headers", {}), "Authorization": f"Bearer {self.key}"}
        try:
            response = await self.client.request(
                method,
                self.url,
                **{**send, "headers": headers},
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
        except httpx.HTTPError as exc:  # an undecodable body, a redirect loop
            raise BadResponse(
                f"{method} {shown(self.url)} failed: {_transport_detail(exc)}", url=self.url
            ) from None
        return self._answer(response)

    def _answer(self, response: httpx.Response) -> httpx.Response | _Retry:
        status = response.status_code
        if 200 <= status < 300:
            return response
        if status in (401, 403):
            raise KeyRejected(
                f"the model endpoint rejected the key (HTTP {status}) at {shown(self.url)}: "
                f"check that the environment variable {self.tinker.api_key_env} (named by "
                f"tinker.api_key_env) holds a valid key for this endpoint",
                url=self.url,
                status=status,
            )
        if status == 404:
            raise WrongURL(
                f"nothing answers at {shown(self.url)} (HTTP 404) for model "
                f"{self.model}: the URL is wrong; check tinker.base_url "
                f"({shown(self.tinker.base_url.strip())}), which may end at the provider "
                f"root (.../api) or at a version (.../v1), or the model id. "
                f"Body: {self.start(response)}",
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
            f"the model endpoint refused the request (HTTP {status}) at {shown(self.url)} "
            f"for model {self.model}: {self.start(response)}",
            url=self.url,
            status=status,
        )

    def chat_result(self, response: httpx.Response, attempt: int) -> ChatResult:
        try:
            data = response.json()
            text = data["choices"][0]["message"].get("content") or ""
            usage = data.get("usage") or {}
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise BadResponse(
                f"the model endpoint answered HTTP {response.status_code} without `choices` "
                f"for model {self.model} at {shown(self.url)}; the body starts: "
                f"{self.start(response)}",
                url=self.url,
                status=response.status_code,
            ) from None
        return ChatResult(
            text=text,
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            status=response.status_code,
            url=self.url,
            model=data.get("model") or self.model,
            attempts=attempt,
        )

    def _proxy_failed(self, detail: str) -> ProxyFailed:
        var = self.proxy_var or "HTTPS_PROXY/HTTP_PROXY/ALL_PROXY"
        return ProxyFailed(
            f"the request to {shown(self.url)} went through the proxy named by {var}, "
            f"and the proxy failed ({detail}): fix or unset {var}, or add the host to NO_PROXY",
            url=self.url,
        )

    def unavailable(self, reason: str, attempts: int, status: int | None) -> EndpointUnavailable:
        return EndpointUnavailable(
            f"the model endpoint at {shown(self.url)} is unavailable after {attempts} "
            f"attempt(s): {reason}; try again later or raise tinker.retry.max_attempts",
            url=self.url,
            status=status,
        )

    def start(self, response: httpx.Response) -> str:
        # Some providers echo the key they refused; it must not reach a log.
        return repr(response.text.replace(self.key, "***")[:_BODY_SHOWN])


def _delay(attempt: int, retry_after: float | None, policy: RetryPolicy) -> float | None:
    """Seconds before the next attempt; None when Retry-After asks for more than we wait."""
    if retry_after is not None and retry_after > policy.max_seconds:
        return None
    return max(policy.delay(attempt), retry_after or 0.0)


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
    return proxy_var(url) if client.trust_env else None


def proxy_var(url: str) -> str | None:
    """The environment variable (as spelled there) whose proxy a request to `url` uses.

    Mirrors httpx: with trust_env it reads the *_proxy variables through urllib, where
    the lowercase spelling wins, ALL_PROXY covers every scheme, and NO_PROXY exempts."""
    parts = urlsplit(url)
    if urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    for name in (f"{parts.scheme}_proxy", "all_proxy"):
        for var in (name, name.upper()):
            if os.environ.get(var):
                return var
    return None


def _transport_detail(exc: httpx.HTTPError) -> str:
    # The text can name a proxy URL, and proxy URLs can carry user:password.
    text = re.sub(r"//[^/@\s]+@", "//***@", str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def shown(url: str) -> str:
    """The URL without user info or query, where a credential could hide."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def model_outage(policy: CompressionConfig) -> Outage:
    """The reporter of the summary model failing, saying what becomes of the traces
    that need it meanwhile."""
    then = (
        "compressed with key_decision_extract (compression.on_model_failure: fallback)"
        if policy.on_model_failure == "fallback"
        else "left compression_failed (compression.on_model_failure: retry)"
    )
    return Outage(
        "the summary model",
        f"traces that need it are retried (compression.retry: {policy.retry.max_attempts} "
        f"attempts), then {then}",
        classify=lambda exc: (type(exc).__name__, str(exc)) if isinstance(exc, LLMError) else None,
        logger="atropos.compression",
        again="answers again",
        level=logging.WARNING,
    )
