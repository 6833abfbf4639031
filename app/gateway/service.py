"""The gateway: each call forwarded to its upstream and captured.

A call goes: rollout named (the path's `/v1/rollouts/{id}/`, an `X-Rollout-Id` header,
or stitched by conversation: app/formats/stitching.py); refused with 503 and
Retry-After while the hub cannot store (before the upstream is paid for); its route
applied (gateway.routes: the model sent, the upstream, fields added or dropped); sent
with the configured key, never the agent's; the answer captured and committed, then
sent. A stream passes each upstream event through as it arrives, but the events that
end the answer (a finish_reason, the usage, `[DONE]`) wait for the capture's commit,
so an agent never holds a whole answer the hub has not stored. An agent that goes
mid-stream leaves its call captured with what had come, marked `disconnected`.

The upstream's errors reach the agent as they are (status, body, Retry-After) and are
captured; an upstream that cannot be reached gets 502, one that does not answer within
the tinker section's timeout_seconds 504, both captured too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.responses import Response

from app.atropos.tables import STATE
from app.config import GatewayConfig, GatewayRoute, PrivacyConfig, TinkerConfig
from app.db.group_commit import GroupCommit
from app.db.types import utcnow
from app.errors import (
    BadGateway,
    BadRequest,
    GatewayTimeout,
    HubError,
    Invalid,
    NotFound,
    Unavailable,
)
from app.evaluation.redaction import Redactor
from app.formats import stitching
from app.gateway import calls as capture
from app.gateway import store
from app.gateway.calls import Kind, StreamAssembly
from app.gateway.relay import RelayedStream
from app.gateway.store import Captured
from app.gateway.upstream import Answer, UpstreamBroken, Upstreams
from app.gateway.writer import CallWriter
from app.llm import api_url, shown

log = logging.getLogger("atropos.gateway")

RESOURCES: dict[Kind, str] = {"chat": "chat/completions", "completion": "completions",
                              "responses": "responses"}
ROLLOUT_HEADER = "X-Rollout-Id"
_ROLLOUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
# Response headers of the upstream's that reach the agent; hop-by-hop ones and those
# the hub sets itself (length, encoding: the body was decoded) do not.
_PASSED = ("content-type", "retry-after", "x-request-id", "openai-model",
           "openai-processing-ms", "x-ratelimit-limit-requests",
           "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
           "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens",
           "x-ratelimit-reset-tokens")
# How long the Atropos trainer's step is trusted before it is read again.
_STEP_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class Upstream:
    url: str
    key_env: str
    route: GatewayRoute | None


class Gateway:
    def __init__(self, engine: AsyncEngine, config: GatewayConfig, tinker: TinkerConfig,
                 privacy: PrivacyConfig, upstreams: Upstreams, writer: CallWriter,
                 retry_after: int) -> None:
        self._engine = engine
        self._config = config
        self._tinker = tinker
        self._upstreams = upstreams
        self._redactor = Redactor(privacy)
        self._writer = writer
        # Why the hub cannot store now (the hub's write_problem, set once it exists).
        self.write_problem: Callable[[], str | None] = lambda: None
        self._retry_after = retry_after
        self._step: tuple[float, str | None] = (-1e9, None)

    @property
    def commits(self) -> GroupCommit[Captured, None]:
        return self._writer.commits

    # --- calls ------------------------------------------------------------------

    async def call(self, kind: Kind, raw: bytes, headers: Mapping[str, str],
                   rollout_id: str | None) -> Response:
        started, started_at = time.monotonic(), utcnow()
        body = _json_object(raw)
        problem = self.write_problem()
        if problem is not None:
            raise Unavailable(f"the hub cannot store this call's capture now ({problem}); "
                              "it was not sent upstream: retry", retry_after=self._retry_after)
        rollout_id = _rollout_id(rollout_id or headers.get(ROLLOUT_HEADER))
        messages = body.get("messages") if kind == "chat" else None
        messages = messages if isinstance(messages, list) else []
        upstream = self._upstream(body.get("model"))
        sent = _rewritten(body, upstream.route)
        version = await self._version(upstream.route)
        # The conversation's rollout: its last call's, when this hub committed it,
        # else looked up while the upstream answers.
        lookup = None
        if rollout_id is None:
            prefixes = stitching.prefixes(messages)
            rollout_id = self._writer.recent.continued(prefixes)
            if rollout_id is None:
                lookup = asyncio.create_task(self._stitched(prefixes))
        try:
            answer = await self._upstreams.send(
                "POST", api_url(upstream.url, RESOURCES[kind]),
                self._headers(upstream, headers), orjson.dumps(sent))
        except (BadGateway, GatewayTimeout) as exc:
            failure: BadGateway | GatewayTimeout | None = exc
        except BaseException:
            if lookup is not None:
                lookup.cancel()
            raise
        else:
            failure = None
        if lookup is not None:
            rollout_id = await lookup
        assert rollout_id is not None
        call = _InFlight(self, kind, body, sent.get("model"), rollout_id, started, started_at,
                     messages, version, bool(body.get("stream")))
        if failure is not None:
            raise await call.failed(failure) from None
        if call.stream and answer.is_success:
            return call.streamed(answer)
        return await call.whole(answer)

    async def _stitched(self, digests: list[str]) -> str:
        """The rollout a call without one continues (by the digests of its prefixes),
        or a new one: also when the captures cannot be read, since the upstream is
        already paid."""
        if digests:
            try:
                async with self._engine.connect() as conn:
                    found = await store.rollout_of(conn, digests)
            except sa.exc.SQLAlchemyError as exc:
                log.warning("a call's conversation could not be looked up (%s): it starts "
                            "a rollout of its own", type(exc).__name__)
                found = None
            if found is not None:
                return found
        return f"gw-{uuid.uuid4().hex}"

    def _upstream(self, model: Any) -> Upstream:
        route = next((r for r in self._config.routes if r.model in ("*", model)), None)
        up = self._config.upstream
        url = (route.base_url if route and route.base_url else None) or up.base_url \
            or self._tinker.base_url
        key_env = (route.api_key_env if route and route.api_key_env else None) \
            or up.api_key_env or self._tinker.api_key_env
        return Upstream(url, key_env, route)

    def _headers(self, upstream: Upstream, incoming: Mapping[str, str]) -> dict[str, str]:
        headers = {"content-type": "application/json",
                   "accept": incoming.get("accept", "application/json")}
        key = os.environ.get(upstream.key_env, "").strip()
        if key:  # else none: a local server (vLLM without --api-key) takes any
            headers["authorization"] = f"Bearer {key}"
        return headers

    async def _version(self, route: GatewayRoute | None) -> str | None:
        """The policy version serving the call: the route's, else the Atropos trainer's
        step while one is registered (read at most once a second)."""
        if route is not None and route.version is not None:
            return route.version
        at, step = self._step
        if time.monotonic() - at < _STEP_SECONDS:
            return step
        # The calls that come while it is read take the step read last: one read, not
        # one per call in flight.
        self._step = (time.monotonic(), step)
        try:
            async with self._engine.connect() as conn:
                row = (await conn.execute(
                    sa.select(STATE.c.registered, STATE.c.step).where(STATE.c.id == 1)
                )).one_or_none()
        except sa.exc.SQLAlchemyError:
            return step
        step = str(row.step) if row is not None and row.registered else None
        self._step = (time.monotonic(), step)
        return step

    # --- the rest of the surface ---------------------------------------------------

    async def models(self) -> Response:
        """The upstream's models, with the routes' own names added."""
        upstream = self._upstream(None)
        listed: dict[str, Any] = {"object": "list", "data": []}
        try:
            answer = await self._upstreams.send("GET", api_url(upstream.url, "models"),
                                                self._headers(upstream, {}))
            content = await answer.read()
            if answer.is_success:
                listed = orjson.loads(content)
        except (BadGateway, GatewayTimeout, UpstreamBroken, orjson.JSONDecodeError):
            log.info("the upstream %s lists no models; the routes' are listed",
                     shown(upstream.url))
        data: list[Any] = listed["data"] if isinstance(listed.get("data"), list) else []
        known = {m.get("id") for m in data if isinstance(m, dict)}
        for route in self._config.routes:
            if route.model != "*" and route.model not in known:
                data.append({"id": route.model, "object": "model", "owned_by": "atropos-hub"})
                known.add(route.model)
        return Response(orjson.dumps({"object": "list", "data": data}),
                        media_type="application/json")

    async def finish(self, rollout_id: str, body: dict[str, Any]) -> dict[str, Any]:
        rollout = _rollout_id(rollout_id)
        assert rollout is not None
        async with self._engine.begin() as conn:
            calls = await store.finish(conn, rollout, body, utcnow())
        if calls is None:
            raise NotFound(f"no call of rollout {rollout!r} was captured: a rollout is "
                           "named by its calls first", field="rollout_id")
        return {"rollout_id": rollout, "calls": calls, "trace_id": rollout}

    # --- capture --------------------------------------------------------------------

    def captured(self, call: _InFlight, record: dict[str, Any]) -> Captured:
        """The record redacted (secrets in what the agent sent or the model said); a
        call whose content held one keeps no token ids, which would spell it out."""
        encoded = orjson.dumps(record)
        if self._redactor.may_hold_secrets(encoded):
            record, found = self._redactor.redact(record, encoded)
            if found:
                record["redactions"] = found
                if record.get("prompt_token_ids") or record.get("token_ids"):
                    record.update(prompt_token_ids=None, token_ids=None, logprobs=None,
                                  tokens_withheld="redacted")
        answer = capture.answer_message(record)
        return Captured(call.rollout_id, uuid.uuid4().hex, call.started_at,
                        stitching.continuation(call.messages, answer), record)


class _InFlight:
    """One call in flight: what its capture is made of."""

    def __init__(self, gateway: Gateway, kind: Kind, body: dict[str, Any],
                 upstream_model: Any, rollout_id: str, started: float,
                 started_at: Any, messages: list[Any], version: str | None,
                 stream: bool) -> None:
        self.gateway = gateway
        self.kind = kind
        self.body = body
        self.upstream_model = upstream_model if isinstance(upstream_model, str) else None
        self.rollout_id = rollout_id
        self.started = started
        self.started_at = started_at
        self.messages = messages
        self.version = version
        self.stream = stream

    def _record(self, status: int, response: Any, error: Any = None,
                first_byte: float | None = None, disconnected: bool = False) -> Captured:
        record = capture.record(
            self.kind, self.body, upstream_model=self.upstream_model, status=status,
            response=response, error=error,
            latency_ms=(time.monotonic() - self.started) * 1000,
            first_byte_ms=None if first_byte is None else (first_byte - self.started) * 1000,
            stream=self.stream, disconnected=disconnected, policy_version=self.version,
        )
        return self.gateway.captured(self, record)

    async def failed(self, error: BadGateway | GatewayTimeout) -> HubError:
        """Capture a call the upstream never answered; returns the refusal to raise."""
        await self.gateway._writer.write(self._record(error.status, None, error.to_json()))
        return error

    async def whole(self, answer: Answer) -> Response:
        try:
            content = await answer.read()
        except UpstreamBroken as exc:
            raise await self.failed(BadGateway(
                f"the upstream's answer broke off: {exc}",
                field="gateway.upstream.base_url")) from None
        parsed = _parsed(content)
        if answer.is_success:
            captured = self._record(answer.status_code, parsed)
        else:
            captured = self._record(answer.status_code, None, error=parsed)
        await self.gateway._writer.write(captured)
        return Response(content, status_code=answer.status_code,
                        headers=_passed(answer.headers, self.rollout_id))

    def streamed(self, answer: Answer) -> Response:
        return RelayedStream(self._events(answer), status_code=answer.status_code,
                             headers=_passed(answer.headers, self.rollout_id))

    async def _events(self, answer: Answer) -> AsyncIterator[bytes]:
        assembly = StreamAssembly(self.kind)
        pending = b""
        held: list[bytes] = []  # the events that end the answer, sent after the commit
        first_byte: float | None = None
        error: Any = None
        finished = False
        try:
            async for data in answer.chunks():
                if first_byte is None:
                    first_byte = time.monotonic()
                pending += data
                out: list[bytes] = []
                while (end := _event_end(pending)) > 0:
                    event, pending = pending[:end], pending[end:]
                    if held or _ends(assembly, event):
                        held.append(event)
                    else:
                        out.append(event)
                if out:
                    yield b"".join(out)
            finished = True
        except UpstreamBroken as exc:
            error = {"error": {"code": "upstream_stream_broken",
                               "message": f"the upstream's stream broke: {exc}"}}
        except BaseException:
            # The agent went (the response task is cancelled): capture what came,
            # marked, without awaiting here.
            self.gateway._writer.detach(self._record(
                answer.status_code, assembly.response(), first_byte=first_byte,
                disconnected=True))
            answer.close()
            raise
        answer.close()
        captured = self._record(answer.status_code, assembly.response(), error=error,
                                first_byte=first_byte)
        try:
            await self.gateway._writer.write(captured)
        except HubError as exc:
            # The answer has begun: no status can say so now. The stream ends short of
            # its last events, which the agent's client reports as a broken stream.
            log.warning("a streamed answer of rollout %s ends short: its capture was not "
                        "stored (%s)", self.rollout_id, exc.message)
            return
        tail = b"".join(held) + (pending if finished else b"")
        if tail:
            yield tail


def _event_end(buffer: bytes) -> int:
    """Where the first complete SSE event of `buffer` ends (past its blank line), or 0."""
    ends = [i + n for i, n in ((buffer.find(b"\n\n"), 2), (buffer.find(b"\r\n\r\n"), 4))
            if i >= 0]
    return min(ends) if ends else 0


def _ends(assembly: StreamAssembly, event: bytes) -> bool:
    """Gather the event's data; True when it ends the answer."""
    ends = False
    for line in event.splitlines():
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            ends = True
            continue
        try:
            ends = assembly.add(orjson.loads(data)) or ends
        except orjson.JSONDecodeError:
            continue
    return ends


def _passed(headers: Mapping[str, str], rollout_id: str) -> dict[str, str]:
    out = {k: v for k, v in headers.items() if k.lower() in _PASSED}
    out[ROLLOUT_HEADER] = rollout_id
    return out


def _parsed(content: bytes) -> Any:
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return content.decode("utf-8", "replace")[:10_000]


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}",
                         code="malformed_json") from None
    if not isinstance(body, dict):
        raise Invalid("the request body must be a JSON object")
    return body


def _rollout_id(value: str | None) -> str | None:
    if value is None:
        return None
    if not _ROLLOUT_ID.fullmatch(value):
        raise Invalid(
            f"rollout id {value[:140]!r}: 1-128 characters, letters, digits and ._:@- "
            "(starting with a letter or digit)", field="rollout_id",
        )
    return value


def _rewritten(body: dict[str, Any], route: GatewayRoute | None) -> dict[str, Any]:
    if route is None:
        return body
    sent = {k: v for k, v in body.items() if k not in route.drop}
    sent.update(route.add)
    if route.upstream_model is not None:
        sent["model"] = route.upstream_model
    return sent
