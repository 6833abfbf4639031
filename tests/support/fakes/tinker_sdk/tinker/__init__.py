"""A stand-in for Thinking Machines' `tinker` SDK (unreachable from here), importable
as `tinker` by a hub process run with tests/support/fakes/tinker_sdk on its PYTHONPATH.

It speaks the part of the SDK the hub uses (ServiceClient, a LoRA TrainingClient,
forward_backward, optim_step, save_state, load_state_with_optimizer,
save_weights_for_sampler; futures with result_async) and keeps the "service's" side in
files, so that it outlives the worker processes a test kills:

- FAKE_TINKER_EVENTS: every call appended as a JSON line, with the model's step count
  (the optim steps its weights hold);
- FAKE_TINKER_HANG: while this file exists, a forward_backward at step
  FAKE_TINKER_HANG_AT (1-based) never returns, as a worker's would when it is killed.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def _event(**fields: Any) -> None:
    with open(os.environ["FAKE_TINKER_EVENTS"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), **fields}) + "\n")


@dataclass
class _Future:
    value: Any = None

    async def result_async(self) -> Any:
        return self.value


class TrainingClient:
    def __init__(self, steps: int = 0) -> None:
        self.steps = steps  # the optim steps these weights hold

    async def forward_backward_async(self, data: list[Any], loss_fn: str) -> _Future:
        hang = os.environ.get("FAKE_TINKER_HANG")
        if hang and Path(hang).exists() and self.steps + 1 == int(os.environ["FAKE_TINKER_HANG_AT"]):
            _event(call="hang", step=self.steps + 1)
            await asyncio.Event().wait()
        tokens = [d.model_input[1] for d in data]
        _event(call="forward_backward", step=self.steps + 1, tokens=tokens, loss_fn=loss_fn)
        return _Future(SimpleNamespace(metrics={"loss:sum": 1.0}))

    async def optim_step_async(self, adam: Any) -> _Future:
        self.steps += 1
        _event(call="optim_step", step=self.steps, learning_rate=adam.learning_rate)
        return _Future()

    async def save_state_async(self, name: str) -> _Future:
        path = f"tinker://fake/state/{name}?steps={self.steps}"
        _event(call="save_state", name=name, path=path)
        return _Future(SimpleNamespace(path=path))

    async def load_state_with_optimizer_async(self, path: str) -> _Future:
        self.steps = int(path.rsplit("steps=", 1)[1])
        _event(call="load_state_with_optimizer", path=path, step=self.steps)
        return _Future()

    async def save_weights_for_sampler_async(self, name: str) -> _Future:
        path = f"tinker://fake/sampler_weights/{name}?steps={self.steps}"
        _event(call="save_weights_for_sampler", name=name, path=path)
        return _Future(SimpleNamespace(path=path))


class ServiceClient:
    def __init__(self, api_key: str | None = None) -> None:
        self.api_key = api_key

    async def create_lora_training_client_async(self, base_model: str, rank: int) -> TrainingClient:
        _event(call="create_lora_training_client", base_model=base_model, rank=rank)
        return TrainingClient()

    async def create_training_client_from_state_async(self, path: str) -> TrainingClient:
        _event(call="create_training_client_from_state", path=path)
        return TrainingClient(int(path.rsplit("steps=", 1)[1]))


types = SimpleNamespace(
    Datum=lambda **kw: SimpleNamespace(**kw),
    ModelInput=SimpleNamespace(from_ints=lambda tokens: ("ints", list(tokens))),
    AdamParams=lambda **kw: SimpleNamespace(**kw),
)
