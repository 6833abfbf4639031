"""The `openai` training backend: an OpenAI-compatible fine-tuning API at
tinker.base_url, called through app.llm (same key, retries and errors as chat).

    POST /v1/files                      the examples as JSONL, purpose fine-tune
    POST /v1/fine_tuning/jobs           {model, training_file, hyperparameters, suffix,
                                         metadata: {idempotency_key}}
    GET  /v1/fine_tuning/jobs/{id}      polled every tinker.poll_interval_seconds until
                                        succeeded, failed or cancelled
    GET  /v1/fine_tuning/jobs?metadata[idempotency_key]=K
                                        finds a job an earlier attempt created but did
                                        not get to record

Idempotency: the key goes out as the `Idempotency-Key` header and in the job's
metadata; the file id and the job are recorded in the receipt as soon as the service
answers, so a redelivery polls the same job. A job that ended failed is kept in
`failed_jobs` and the next attempt creates a new one under `key.N`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import orjson

from app.config import TinkerConfig
from app.errors import TrainingFailed, TrainingTimeout
from app.llm import request
from app.training import Example, TrainingRun, hyperparameters

FINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})


class OpenAIFineTuning:
    name = "openai"

    def __init__(self, tinker: TinkerConfig, http: httpx.AsyncClient) -> None:
        self._tinker = tinker
        self._http = http

    async def train(self, run: TrainingRun) -> dict[str, Any]:
        receipt, log = run.receipt, run.log
        job = receipt.get("job")
        if job is not None and job.get("state") in ("failed", "cancelled"):
            receipt.setdefault("failed_jobs", []).append(receipt.pop("job"))
            job = None
        failed = len(receipt.get("failed_jobs", []))
        job_key = f"{run.key}.{failed}" if failed else run.key
        if job is None:
            job = await self._find(job_key)
            if job is not None:
                log.line(f"found job {job['id']} created by an earlier attempt ({job_key})")
        if job is None:
            if "file_id" not in receipt:
                receipt["file_id"] = await self._upload(run.examples, run.key)
                log.line(f"uploaded training file {receipt['file_id']} "
                         f"({len(run.examples)} examples)")
                await run.save()
            job = await self._create(receipt["file_id"], job_key)
            log.line(f"created fine-tuning job {job['id']} for {self._tinker.model_id}")
        receipt["job"] = job
        await run.save()
        job = await self._poll(job, run)
        if job["state"] != "succeeded":
            raise TrainingFailed(f"fine-tuning job {job['id']} ended {job['state']}: "
                                 f"{job.get('error') or 'no error given'}")
        if not job["model"]:
            raise TrainingFailed(f"fine-tuning job {job['id']} succeeded without naming "
                                 "its fine_tuned_model")
        return job

    async def _upload(self, examples: list[Example], key: str) -> str:
        body = b"".join(orjson.dumps(e.record) + b"\n" for e in examples)
        answer = await request(
            self._http, self._tinker, "POST", "files",
            files={"file": (f"{key}.jsonl", body, "application/jsonl")},
            data={"purpose": "fine-tune"},
            headers={"Idempotency-Key": f"{key}:file"},
        )
        return str(answer["id"])

    async def _create(self, file_id: str, job_key: str) -> dict[str, Any]:
        t = self._tinker
        answer = await request(
            self._http, t, "POST", "fine_tuning/jobs",
            json={
                "model": t.model_id,
                "training_file": file_id,
                "hyperparameters": hyperparameters(t),
                "suffix": job_key[-40:],
                "metadata": {"idempotency_key": job_key},
            },
            headers={"Idempotency-Key": job_key},
        )
        return _record(answer)

    async def _find(self, job_key: str) -> dict[str, Any] | None:
        answer = await request(
            self._http, self._tinker, "GET", "fine_tuning/jobs",
            params={"metadata[idempotency_key]": job_key, "limit": 1},
        )
        found = [j for j in answer.get("data") or []
                 if (j.get("metadata") or {}).get("idempotency_key") == job_key]
        return _record(found[0]) if found else None

    async def _poll(self, job: dict[str, Any], run: TrainingRun) -> dict[str, Any]:
        t = self._tinker
        deadline = time.monotonic() + t.job_timeout_seconds
        while job["state"] not in FINAL_STATES:
            if time.monotonic() > deadline:
                raise TrainingTimeout(
                    f"fine-tuning job {job['id']} still {job['state']} after "
                    f"tinker.job_timeout_seconds ({t.job_timeout_seconds:g} s)"
                )
            await asyncio.sleep(t.poll_interval_seconds)
            answer = await request(self._http, t, "GET", f"fine_tuning/jobs/{job['id']}")
            polled = _record(answer)
            if polled["state"] != job["state"]:
                run.log.line(f"job {job['id']}: {job['state']} -> {polled['state']}")
                run.receipt["job"] = polled
                await run.save()
            job = polled
        if job["state"] == "succeeded":
            run.log.line(f"job {job['id']} succeeded: fine-tuned model {job['model']}")
        return job


def _record(job: dict[str, Any]) -> dict[str, Any]:
    """What the receipt keeps of a job object."""
    error = job.get("error")
    if isinstance(error, dict):
        error = error.get("message") or error.get("code")
    return {
        "id": str(job["id"]),
        "state": str(job.get("status") or "unknown"),
        "model": job.get("fine_tuned_model"),
        "base_model": job.get("model"),
        "training_file": job.get("training_file"),
        "error": error,
    }
