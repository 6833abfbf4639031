"""What a target is: a `Target` delivers a `Batch`; a target module declares a
`TargetSpec` (its name, its distributor keys, how to build it) and is registered in
app/targets/__init__.py."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import httpx
import orjson

from app import formats
from app.config import DistributorConfig, TinkerConfig
from app.domain import Trace
from app.errors import DeliveryError, Unexportable
from app.training import SaveReceipt

__all__ = ["Batch", "BatchFile", "BatchItem", "DeliveryError", "FileTarget", "Resources",
           "Rollout", "RolloutSink", "SaveReceipt", "Target", "TargetSpec", "render_file"]

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
        out, left_out = _exported(self.items, fmt)
        _say_left_out(self.batch_id, fmt, left_out)
        return out


def _exported(items: list[BatchItem], fmt: str
              ) -> tuple[list[tuple[BatchItem, dict[str, Any]]], list[tuple[str, str]]]:
    """Each item's record in `fmt`, and (trace_id, why) of those the format cannot hold."""
    out, left_out = [], []
    for item in items:
        try:
            out.append((item, item.record(fmt)))
        except Unexportable as exc:
            left_out.append((item.trace_id, exc.message))
    return out, left_out


def _say_left_out(batch_id: str, fmt: str, left_out: list[tuple[str, str]]) -> None:
    for trace_id, why in left_out:
        log.warning("batch %s: trace %s left out of the %s file: %s", batch_id, trace_id,
                    fmt, why)


@dataclass(frozen=True)
class BatchFile:
    """A batch as the file a `FileTarget` writes: its records in `fmt`, a JSON line each
    (`body`), with what its manifest line lists."""

    batch_id: str
    created_at: datetime
    fmt: str
    body: bytes
    sha256: str  # of body
    trace_ids: list[str]  # of the records, in order
    rewards: list[float | None]  # the hub's, aligned with trace_ids
    env_rewards: list[float | None]  # the environment's own (None when it sent none)
    left_out: list[tuple[str, str]]  # (trace_id, why): traces the format cannot hold

    @classmethod
    def of(cls, batch_id: str, created_at: datetime, items: list[BatchItem],
           fmt: str) -> BatchFile:
        records, left_out = _exported(items, fmt)
        body = b"".join(orjson.dumps(record) + b"\n" for _, record in records)
        return cls(batch_id, created_at, fmt, body, hashlib.sha256(body).hexdigest(),
                   [item.trace_id for item, _ in records],
                   [item.reward for item, _ in records],
                   [item.env_reward for item, _ in records], left_out)

    def say_left_out(self) -> None:
        """The traces left out, in the log of the process that delivers the batch."""
        _say_left_out(self.batch_id, self.fmt, self.left_out)


def render_file(batch_id: str, created_at: datetime,
                members: list[tuple[str, float | None, str, bool]], fmt: str) -> BatchFile:
    """The file of a batch whose members are (trace_id, reward, the payload to send as
    its JSON text, whether that is the compressed view): parsing, exporting and
    encoding are the CPU of a delivery, so this runs in an ingest process of its own
    (app/ingest/processes.py `apart`), not in the serving process."""
    items = [BatchItem(trace_id, reward, Trace.model_validate_json(payload), compressed)
             for trace_id, reward, payload, compressed in members]
    return BatchFile.of(batch_id, created_at, items, fmt)


class Target(Protocol):
    name: str

    async def deliver(self, batch: Batch, save: SaveReceipt) -> dict[str, Any]:
        """Hand `batch` over; return the receipt. `save` records progress that a later
        attempt should resume from."""
        ...


@runtime_checkable
class FileTarget(Protocol):
    """A target that writes each batch as a file of records in `fmt` (`BatchFile`),
    whatever order they come in: delivery has the files rendered in the ingest
    processes and hands a pass's files over at once (`write_files`), so that their
    writes and fsyncs overlap and what the pass shares (a directory's fsync, a
    manifest's append) is paid once."""

    fmt: str

    async def write_files(self, files: list[BatchFile]) -> list[dict[str, Any] | Exception]:
        """Each file's receipt, or what failed it (each fails alone), in order."""
        ...


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
