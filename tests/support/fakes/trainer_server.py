"""A fake HTTP trainer for the `http` target, served like the fake model (use
`tests.support.fakes.model_server.serve`): `POST /batches` with a gzip JSON body and an
`Idempotency-Key` header, answered as a real idempotent receiver would.

    trainer = FakeTrainer(failures=2)   # the first two requests get 503
    trainer.delay = 3.0                 # every request waits (to kill a worker mid-delivery)

`requests` records every request that arrived (key, batch id, trace ids); `accepted`
holds each key once, with the trace ids it was first accepted with.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


@dataclass
class Arrived:
    key: str | None
    batch_id: str
    trace_ids: list[str]
    records: list[dict[str, object]]
    encoding: str | None


@dataclass
class FakeTrainer:
    failures: int = 0  # answer 503 to this many requests first
    always_fail: bool = False
    delay: float = 0.0
    requests: list[Arrived] = field(default_factory=list)
    accepted: dict[str, list[str]] = field(default_factory=dict)

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/batches", self._handle, methods=["POST"])])

    async def _handle(self, request: Request) -> Response:
        raw = await request.body()
        encoding = request.headers.get("content-encoding")
        body = json.loads(gzip.decompress(raw) if encoding == "gzip" else raw)
        key = request.headers.get("idempotency-key")
        traces = body["traces"]
        self.requests.append(
            Arrived(key, body["batch_id"], [t["trace_id"] for t in traces], traces, encoding)
        )
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.always_fail or self.failures > 0:
            self.failures -= 1
            return JSONResponse({"error": "trainer busy"}, 503)
        if key is None:
            return JSONResponse({"error": "Idempotency-Key required"}, 400)
        duplicate = key in self.accepted
        self.accepted.setdefault(key, [t["trace_id"] for t in traces])
        return JSONResponse({"accepted": True, "duplicate": duplicate}, 200)
