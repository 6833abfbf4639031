"""Training: one job over a set of chat examples on the backend that tinker.backend
chooses, then one smoke request to the model it produced.

    run(backend, TrainingRun(examples, key, receipt, persist, log), http=..., tinker=...)

Backends (each in its own module):
    openai   an OpenAI-compatible fine-tuning API at tinker.base_url: upload the
             examples as a file, create a job, poll it to a final state
    tinker   Thinking Machines' `tinker` SDK (optional extra): a LoRA training client,
             forward_backward + optim_step over the examples, then save the weights

`key` is the idempotency key (a batch id, or a run id for `atropos train`). A backend
records its progress in `receipt` through `save` as it goes (file uploaded, job
created), so a second attempt with the same receipt resumes the same job instead of
training twice.

When the job has succeeded, `run` asks the resulting model one question through chat
completions and writes `Model request completed: status=200, tokens=N` to the trainer
log (`trainer_{run_id}.log`), the line the seed documents tell users to look for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import httpx

from app import files
from app.config import TinkerConfig
from app.errors import TrainingFailed
from app.llm import chat

__all__ = [
    "Backend",
    "Example",
    "SaveReceipt",
    "TrainerLog",
    "TrainingFailed",
    "TrainingRun",
    "backend_for",
    "hyperparameters",
    "run",
]

log = logging.getLogger("atropos.trainer")
SMOKE_PROMPT = "Reply with one short sentence: are you ready?"
SaveReceipt = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class Example:
    """One supervised example: an OpenAI chat fine-tuning record (`messages`, `tools`?)
    and, when the trace carried them, its token ids and Atropos-style masks (-100
    where the position is not trained on)."""

    record: dict[str, Any]
    tokens: list[int] | None = None
    masks: list[int] | None = None


class TrainerLog:
    """`trainer_{run_id}.log` in `directory`, one timestamped line per event; every line
    also goes to the hub's own log on stderr."""

    def __init__(self, directory: str | Path, run_id: str) -> None:
        self.path = Path(directory).expanduser() / f"trainer_{run_id}.log"
        files.make_dir(self.path.parent)
        self._file: IO[str] = files.open_new(self.path, "a", encoding="utf-8")

    def line(self, text: str, level: int = logging.INFO) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        self._file.write(f"{stamp} {logging.getLevelName(level)} {text}\n")
        self._file.flush()
        log.log(level, "%s", text)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TrainerLog:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


@dataclass
class TrainingRun:
    """One run as a backend sees it: the examples, the idempotency key, the receipt
    (what earlier attempts recorded; a backend updates it in place and `save()`s it as
    it goes) and the trainer log."""

    examples: list[Example]
    key: str
    receipt: dict[str, Any]
    persist: SaveReceipt
    log: TrainerLog

    async def save(self) -> None:
        await self.persist(self.receipt)


class Backend(Protocol):
    name: str

    async def train(self, run: TrainingRun) -> dict[str, Any]:
        """Run (or resume, from `run.receipt`) one job to its end; return its record
        `{"id", "state", "model", ...}` with `model` the resulting model's id. Raises
        TrainingFailed when the job ends failed."""
        ...


def hyperparameters(tinker: TinkerConfig) -> dict[str, Any]:
    """The hyperparameters a job is created with, from tinker.json."""
    params: dict[str, Any] = {
        "n_epochs": tinker.epochs,
        "batch_size": tinker.batch_size,
        "learning_rate": tinker.learning_rate,
        "training_mode": tinker.training_mode,
    }
    if tinker.training_mode == "lora":
        params["lora_rank"] = tinker.lora_rank
    return params


def backend_for(tinker: TinkerConfig, http: httpx.AsyncClient) -> Backend:
    """The backend tinker.backend names. The tinker SDK is imported only when chosen."""
    if tinker.backend == "tinker":
        from app.training.tinker_sdk import TinkerSDK

        return TinkerSDK(tinker)
    from app.training.openai_api import OpenAIFineTuning

    return OpenAIFineTuning(tinker, http)


async def run(
    backend: Backend, job: TrainingRun, *, http: httpx.AsyncClient, tinker: TinkerConfig
) -> dict[str, Any]:
    """Train on the run's examples, then smoke-test the resulting model. Returns the
    receipt: `{"job": {...}, "smoke": {...}, ...}`."""
    job.log.line(
        f"training run {job.key}: {len(job.examples)} examples, backend {backend.name}, "
        f"base model {tinker.model_id}, hyperparameters {hyperparameters(tinker)}"
    )
    job.receipt["job"] = await backend.train(job)
    await job.save()
    job.receipt["smoke"] = await smoke_request(http, tinker, job.receipt["job"]["model"], job.log)
    return job.receipt


async def smoke_request(
    http: httpx.AsyncClient, tinker: TinkerConfig, model: str, log: TrainerLog
) -> dict[str, Any]:
    """One chat completion from `model`: proof that the trained model answers."""
    result = await chat(
        http, tinker, [{"role": "user", "content": SMOKE_PROMPT}], max_tokens=32, model=model
    )
    log.line(f"Model request completed: status={result.status}, tokens={result.total_tokens}")
    return {"model": model, "status": result.status, "tokens": result.total_tokens,
            "url": result.url}
