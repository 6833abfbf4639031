"""`atropos train --config tinker.json --dataset FILE.jsonl --output DIR`: one training
job from a dataset file, as the seed documents run it: upload, job, poll, smoke request.

DIR receives `job.json` (run id, job id, state, fine-tuned model id, the smoke
request), `hyperparameters.json` and `trainer_<run_id>.log`. `job.json` is written as
the job goes, so running the same command again after an interruption resumes the
same job instead of starting a second one.

Lines are OpenAI chat records (`messages`); a line in any other format the hub reads
(ShareGPT/Hermes, ATIF, native: e.g. from `atropos export`) is converted to one.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import orjson

from app import files, formats
from app.config import TinkerConfig
from app.errors import ConfigError, HubError
from app.training import Example, TrainerLog, TrainingRun, backend_for, hyperparameters, run

JOB_FILE = "job.json"


def read_examples(path: Path) -> list[Example]:
    examples = []
    try:
        with open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    examples.append(Example(_record(line, path, number)))
    except OSError as exc:
        raise ConfigError(f"--dataset: cannot read {path}: {exc.strerror or exc}") from None
    if not examples:
        raise ConfigError(f"--dataset: {path} holds no examples")
    return examples


def _record(line: bytes, path: Path, number: int) -> dict[str, Any]:
    try:
        item = orjson.loads(line)
        if isinstance(item, dict) and isinstance(item.get("messages"), list):
            return item
        return formats.export(formats.parse(item), "openai")
    except (orjson.JSONDecodeError, HubError) as exc:
        raise ConfigError(f"--dataset: {path} line {number}: {exc}") from None


async def train_dataset(tinker: TinkerConfig, dataset: Path, output: Path) -> dict[str, Any]:
    """Run (or resume) the job; returns the job record written to DIR/job.json."""
    examples = read_examples(dataset)
    files.make_dir(output)
    job_file = output / JOB_FILE
    state: dict[str, Any] = json.loads(job_file.read_text()) if job_file.exists() else {}
    run_id = state.get("run_id") or uuid.uuid4().hex[:8]
    record: dict[str, Any] = {"run_id": run_id, "dataset": str(dataset),
                              "examples": len(examples), "receipt": state.get("receipt", {})}
    _write_json(output / "hyperparameters.json",
                {"model_id": tinker.model_id, "backend": tinker.backend, **hyperparameters(tinker)})

    async def save(receipt: dict[str, Any]) -> None:
        record["receipt"] = receipt
        _write_json(job_file, record)

    await save(record["receipt"])
    async with httpx.AsyncClient() as http:
        with TrainerLog(output, run_id) as log:
            job = TrainingRun(examples, f"train-{run_id}", record["receipt"], save, log)
            receipt = await run(backend_for(tinker, http), job, http=http, tinker=tinker)
    await save(receipt)
    return record


def _write_json(path: Path, value: dict[str, Any]) -> None:
    with files.replaced(path) as f:
        f.write((json.dumps(value, indent=2) + "\n").encode())
