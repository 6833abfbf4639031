"""The `tinker` target: each batch is one training job on the service tinker.json
names (backend `openai` or `tinker`, see app.training), then a smoke request to the
resulting model. The examples are OpenAI chat records whatever distributor.format
says: that is what fine-tuning takes. The trainer log is
`tinker.logs_dir/trainer_<batch_id>.log`.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import httpx

from app.config import TinkerConfig, TinkerTargetConfig
from app.errors import DeliveryError
from app.targets.base import Batch, BatchItem, Resources, SaveReceipt, TargetSpec
from app.training import Backend, Example, TrainerLog, TrainingRun, backend_for, run


class TinkerTarget:
    name = "tinker"

    def __init__(
        self, tinker: TinkerConfig, http: httpx.AsyncClient, backend: Backend | None = None
    ) -> None:
        self._tinker = tinker
        self._http = http
        self._backend = backend or backend_for(tinker, http)

    async def deliver(self, batch: Batch, save: SaveReceipt) -> dict[str, Any]:
        examples = [_example(item, record) for item, record in batch.records("openai")]
        try:
            log = TrainerLog(self._tinker.logs_dir, batch.batch_id)
        except OSError as exc:
            raise DeliveryError(f"cannot open the trainer log in tinker.logs_dir: {exc}") from exc
        with log:
            job = TrainingRun(examples, batch.batch_id, dict(batch.receipt), save, log)
            return await run(self._backend, job, http=self._http, tinker=self._tinker)


def _example(item: BatchItem, record: dict[str, Any]) -> Example:
    meta = item.trace.metadata
    tokens = meta.get("tokens")
    if item.compressed or not _ints(tokens):
        return Example(record)
    masks = meta.get("masks")
    if not (_ints(masks) and len(masks) == len(tokens)):
        masks = None
    return Example(record, tokens=tokens, masks=masks)


def _ints(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and bool(value) and all(isinstance(v, int) for v in value)


def _build(config: TinkerTargetConfig, resources: Resources) -> TinkerTarget:
    return TinkerTarget(resources.tinker, resources.http)


SPEC = TargetSpec("tinker", TinkerTargetConfig, _build)
