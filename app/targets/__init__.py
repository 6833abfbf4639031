"""Where batches go: the target that distributor.target names.

    jsonl   a training file per batch in distributor.output_dir, plus manifest.jsonl
    http    a POST to distributor.url, with the batch id as the Idempotency-Key
    tinker  a training job on the service tinker.json names (app.training)

`deliver(batch, save)` returns the receipt (what the target reported) or raises; the
delivery stage retries and acknowledges. Every target is idempotent on `batch_id`: a
batch delivered twice (a worker died before acknowledging) is written, accepted or
trained once.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import httpx

from app import formats
from app.config import DistributorConfig, TinkerConfig
from app.domain import Trace
from app.errors import Unexportable

log = logging.getLogger("atropos.delivery")

__all__ = ["Batch", "BatchItem", "DeliveryError", "SaveReceipt", "Target", "build_target"]

SaveReceipt = Callable[[dict[str, Any]], Awaitable[None]]


class DeliveryError(Exception):
    """A delivery that failed in a way the target could describe (the message becomes
    the batch's last_error)."""


@dataclass(frozen=True)
class BatchItem:
    trace_id: str
    reward: float | None
    trace: Trace
    compressed: bool  # `trace` is the compressed view (token ids no longer match)

    def record(self, fmt: str) -> dict[str, Any]:
        return formats.export(self.trace, fmt)


@dataclass(frozen=True)
class Batch:
    batch_id: str
    created_at: datetime
    attempts: int
    items: list[BatchItem]
    # What earlier attempts recorded (a training job under way); {} on the first.
    receipt: dict[str, Any]

    def records(self, fmt: str) -> list[tuple[BatchItem, dict[str, Any]]]:
        """Each item's record in `fmt`, less those the format cannot hold (an OpenAI
        record needs an assistant turn): a trainer gets nothing it cannot load."""
        out = []
        for item in self.items:
            try:
                out.append((item, item.record(fmt)))
            except Unexportable as exc:
                log.warning("batch %s: trace %s left out of the %s file: %s",
                            self.batch_id, item.trace_id, fmt, exc.message)
        return out


class Target(Protocol):
    name: str

    async def deliver(self, batch: Batch, save: SaveReceipt) -> dict[str, Any]:
        """Hand `batch` over; return the receipt. `save` records progress that a later
        attempt should resume from."""
        ...


def build_target(
    distributor: DistributorConfig, tinker: TinkerConfig, http: httpx.AsyncClient
) -> Target:
    if distributor.target == "jsonl":
        from app.targets.jsonl import JsonlTarget

        return JsonlTarget(distributor.output_dir, distributor.format)
    if distributor.target == "http":
        from app.targets.http import HttpTarget

        assert distributor.url is not None  # checked when config.json is loaded
        return HttpTarget(distributor.url, distributor.format, http,
                          timeout=distributor.http_timeout_seconds)
    from app.targets.tinker import TinkerTarget

    return TinkerTarget(tinker, http)
