"""The `http` target: POST each batch to distributor.url as gzip JSON,

    {"batch_id", "created_at", "format",
     "traces": [{"trace_id", "reward", "env_reward", ...record}]}

where each record is the trace in distributor.format, with the header
`Idempotency-Key: <batch_id>`. Any 2xx acknowledges; anything else (or no answer) is
a failed attempt, retried by the delivery stage with the same key and body.
"""

from __future__ import annotations

import gzip
from typing import Any

import httpx
import orjson

from app.config import HttpTargetConfig
from app.targets.base import Batch, DeliveryError, Resources, SaveReceipt, TargetSpec

_BODY_SHOWN = 200


class HttpTarget:
    name = "http"

    def __init__(self, url: str, fmt: str, http: httpx.AsyncClient, *, timeout: float) -> None:
        self._url = url
        self._fmt = fmt
        self._http = http
        self._timeout = timeout

    async def deliver(self, batch: Batch, save: SaveReceipt) -> dict[str, Any]:
        body = {
            "batch_id": batch.batch_id,
            "created_at": batch.created_at.isoformat(),
            "format": self._fmt,
            "traces": [
                {
                    **record,
                    "trace_id": item.trace_id,
                    "reward": item.reward,
                    "env_reward": item.env_reward,
                }
                for item, record in batch.records(self._fmt)
            ],
        }
        try:
            response = await self._http.post(
                self._url,
                content=gzip.compress(orjson.dumps(body), compresslevel=5),
                headers={
                    "Content-Type": "application/json",
                    "Content-Encoding": "gzip",
                    "Idempotency-Key": batch.batch_id,
                },
                timeout=self._timeout,
            )
        except httpx.HTTPError as exc:
            raise DeliveryError(
                f"POST {self._url} failed: {type(exc).__name__}: {exc or 'no answer'}"
            ) from None
        if not response.is_success:
            raise DeliveryError(
                f"POST {self._url} answered HTTP {response.status_code}: "
                f"{response.text[:_BODY_SHOWN]!r}"
            )
        return {"url": self._url, "status": response.status_code}


def _build(config: HttpTargetConfig, resources: Resources) -> HttpTarget:
    return HttpTarget(config.url, config.format, resources.http,
                      timeout=config.http_timeout_seconds)


SPEC = TargetSpec("http", HttpTargetConfig, _build)
