"""The `atropos` target: each passing trace becomes a rollout, a sequence of a scored
group in the hub's own Atropos queue (app/atropos/hub_env.py forms the groups), which
GET /batch serves to unchanged trainers beside the groups envs send.

A rollout's tokens are the ids the gateway captured when it has them, exact (the
sequence holds every call's generation as the model made it), with the logprobs when
every generated position has one; otherwise the trace's conversation rendered with the
policy's chat template from tinker.tokenizer (app/training/chat_template.py), with no
logprobs: none is invented. A trace with neither, or without the score
distributor.score names, is kept as unusable, with the reason, and counted.

Its group: the `group` its metadata names (given at /v1/rollouts/{id}/finish, or
sent with the trace), else its task, whitespace-normalised.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from typing import Any

from app.config import AtroposTargetConfig
from app.errors import DeliveryError, Unexportable
from app.targets.base import (
    Batch,
    BatchItem,
    Resources,
    Rollout,
    RolloutSink,
    SaveReceipt,
    TargetSpec,
)
from app.training.chat_template import ChatTokenizer, NotRenderable, load_tokenizer, render


def group_key(metadata: dict[str, Any], task: str) -> str:
    """What the trajectories of one group share."""
    group = metadata.get("group")
    if isinstance(group, (str, int)) and not isinstance(group, bool) and str(group):
        return f"group:{group}"
    return "task:" + " ".join(task.split())


def _sent_by_an_env(metadata: dict[str, Any]) -> bool:
    """A trajectory the env groups stage made of a group an env sent
    (app/stages/env_groups.py): grouped again, the trainer would learn from it twice."""
    atropos = metadata.get("atropos")
    return isinstance(atropos, dict) and "env_id" in atropos


class AtroposTarget:
    name = "atropos"

    def __init__(self, config: AtroposTargetConfig, tokenizer: str | None,
                 groups: RolloutSink) -> None:
        """`tokenizer`: tinker.tokenizer, loaded when a trace without captured ids
        first needs it."""
        self._config = config
        self._tokenizer_name = tokenizer
        self._tokenizer: ChatTokenizer | None = None
        self._loading = threading.Lock()
        self._groups = groups

    async def deliver(self, batch: Batch, save: SaveReceipt) -> dict[str, Any]:
        # Rendering and tokenizing is CPU work: off the event loop.
        rollouts = await asyncio.to_thread(lambda: [self._rollout(i) for i in batch.items])
        return await self._groups.add(batch.batch_id, rollouts)

    def _rollout(self, item: BatchItem) -> Rollout:
        trace = item.trace
        score = item.reward if self._config.score == "reward" else item.env_reward
        try:
            record: dict[str, Any] | None = item.record("openai")
        except Unexportable:
            record = None
        base = Rollout(
            trace_id=item.trace_id, group_key=group_key(trace.metadata, trace.task),
            score=score, tokens=[], masks=[], logprobs=None,
            messages=record["messages"] if record is not None else None, exact=False,
            policy_version=trace.policy_version,
            unusable=None if score is not None
            else f"no {self._config.score} to score it by (distributor.score)",
        )
        if _sent_by_an_env(trace.metadata):
            return replace(base, unusable="a rollout an Atropos env sent in a group of its "
                                          "own, which the trainer gets as sent")
        view = item.tokens
        if view is not None and view.get("exact"):
            logprobs = view["logprobs"]
            complete = all(isinstance(v, (int, float)) for v in logprobs)
            return replace(base, tokens=view["tokens"], masks=view["masks"], exact=True,
                           logprobs=[float(v) for v in logprobs] if complete else None)
        if base.unusable is not None:
            return base
        if record is None:
            return replace(base, unusable="no assistant turn: nothing for the policy to learn")
        if self._tokenizer_name is None:
            return replace(base, unusable="no exact token ids captured, and no "
                                          "tinker.tokenizer to render its messages with")
        try:
            rendered = render(self._tokenizer_loaded(), record["messages"], record.get("tools"))
        except NotRenderable as exc:
            return replace(base, unusable=str(exc))
        return replace(base, tokens=rendered.tokens, masks=rendered.masks)

    def _tokenizer_loaded(self) -> ChatTokenizer:
        with self._loading:
            if self._tokenizer is None:
                assert self._tokenizer_name is not None
                try:
                    self._tokenizer = load_tokenizer(self._tokenizer_name)
                except (OSError, ImportError, ValueError) as exc:
                    raise DeliveryError(
                        f"tinker.tokenizer {self._tokenizer_name!r} cannot be loaded from "
                        f"this machine (nothing is downloaded): {type(exc).__name__}: {exc}"
                    ) from None
            return self._tokenizer


def _build(config: AtroposTargetConfig, resources: Resources) -> AtroposTarget:
    if resources.groups is None:
        raise ValueError("the atropos target needs the hub's Atropos queue")
    return AtroposTarget(config, resources.tinker.tokenizer, resources.groups)


SPEC = TargetSpec("atropos", AtroposTargetConfig, _build)
