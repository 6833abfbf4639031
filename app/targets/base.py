"""What a target is: a `Target` delivers a `Batch`; a target module declares a
`TargetSpec` (its name, its distributor keys, how to build it) and is registered in
app/targets/__init__.py."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import httpx

from app import formats
from app.config import DistributorConfig, TinkerConfig
from app.domain import Trace
from app.errors import DeliveryError, Unexportable
from app.training import SaveReceipt

__all__ = ["Batch", "BatchItem", "DeliveryError", "Resources", "Rollout", "RolloutSink",
           "SaveReceipt", "Target", "TargetSpec"]

log = logging.getLogger("atropos.delivery")

@dataclass(frozen=True)
class BatchItem:
    trace_id: str
    reward: float | None
    trace: Trace
    compressed: bool  # `trace` is the compressed view (token ids no longer match)
    # The token ids the gateway captured (app/gateway/tokens.py's view), for a trace that
    # came through it with ids; None otherwise.
    tokens: dict[str, Any] | None = None

    @property
    def env_reward(self) -> float | None:
        """The environment's own reward (the row's env_reward), None when it sent none."""
        return self.trace.outcome.reward

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


@runtime_checkable
class Unordered(Protocol):
    """A target whose batches do not depend on the order they arrive in (each a file of
    its own): delivery hands over a pass's batches at once, so that their writes (and
    fsyncs) overlap, instead of one after the other."""

    unordered: bool


@dataclass(frozen=True)
class Rollout:
    """One trajectory as an RL trainer takes it: a sequence of a scored group."""

    trace_id: str
    group_key: str  # trajectories of one key form a group
    score: float | None
    tokens: list[int]
    masks: list[int]  # -100 where the model did not generate; the token id where it did
    # Per position, only when the gateway captured every generated one: never invented.
    logprobs: list[float] | None
    messages: list[dict[str, Any]] | None  # the conversation the tokens render, if known
    exact: bool  # the ids the model saw and produced, as captured
    policy_version: str | None
    # Why it cannot be a sequence of any group (no tokens, no score); None when it can.
    unusable: str | None = None


class RolloutSink(Protocol):
    """Where the `atropos` target puts rollouts: the hub's own Atropos env
    (app/atropos/hub_env.py), which forms them into groups."""

    async def add(self, batch_id: str, rollouts: list[Rollout]) -> dict[str, Any]:
        """Keep the rollouts (each once, whatever the attempt) and form the groups that
        are full; returns the receipt."""
        ...


@dataclass(frozen=True)
class Resources:
    """What a target may use beyond its own keys."""

    http: httpx.AsyncClient  # shared by the stages, closed when they stop
    tinker: TinkerConfig  # tinker.json
    # The hub's Atropos queue, for the `atropos` target.
    groups: RolloutSink | None = None


C = TypeVar("C", bound=DistributorConfig)


@dataclass(frozen=True)
class TargetSpec(Generic[C]):
    """One kind of target, as `distributor.target` names it."""

    name: str
    # config.json's distributor section for this target: the keys every target shares
    # (DistributorConfig) plus its own (app/config.py TARGET_CONFIGS).
    config: type[C]
    build: Callable[[C, Resources], Target]
