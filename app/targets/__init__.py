"""Where batches go: the target that distributor.target names.

    jsonl   a training file per batch in distributor.output_dir, plus manifest.jsonl
    http    a POST to distributor.url, with the batch id as the Idempotency-Key
    tinker  a training job on the service tinker.json names (app.training)
    atropos scored groups in the hub's own Atropos queue, for GET /batch

`deliver(batch, save)` returns the receipt (what the target reported) or raises; the
delivery stage retries and acknowledges. Every target is idempotent on `batch_id`: a
batch delivered twice (a worker died before acknowledging) is written, accepted or
trained once.

A target is one module that declares a `SPEC` (app/targets/base.py: its name, its
distributor keys, its builder), plus its line in REGISTERED below. Its keys are a
DistributorConfig subclass in app/config.py's TARGET_CONFIGS, which checks
config.json's distributor section against the model of the target it names: the
config sits below the code that uses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import httpx

from app.config import DistributorConfig, TinkerConfig
from app.targets import atropos as atropos_target
from app.targets import http as http_target
from app.targets import jsonl as jsonl_target
from app.targets import tinker as tinker_target
from app.targets.base import (
    Batch,
    BatchFile,
    BatchItem,
    DeliveryError,
    FileTarget,
    Resources,
    Rollout,
    RolloutSink,
    SaveReceipt,
    Target,
    TargetSpec,
)

__all__ = [
    "REGISTERED",
    "TARGETS",
    "Batch",
    "BatchFile",
    "BatchItem",
    "DeliveryError",
    "FileTarget",
    "Resources",
    "Rollout",
    "RolloutSink",
    "SaveReceipt",
    "Target",
    "TargetSpec",
    "build_target",
]

# The registration (in the order config errors list them).
REGISTERED: tuple[TargetSpec[Any], ...] = (
    tinker_target.SPEC,
    jsonl_target.SPEC,
    http_target.SPEC,
    atropos_target.SPEC,
)
TARGETS: Mapping[str, TargetSpec[Any]] = MappingProxyType({t.name: t for t in REGISTERED})


def build_target(
    distributor: DistributorConfig, tinker: TinkerConfig, http: httpx.AsyncClient,
    groups: RolloutSink | None = None,
) -> Target:
    spec = TARGETS[distributor.target]
    config = (
        distributor
        if isinstance(distributor, spec.config)
        else spec.config.model_validate(distributor.model_dump())
    )
    return spec.build(config, Resources(http, tinker, groups))
