"""The `jsonl` target: one training file per batch, `<batch_id>.jsonl` in
distributor.output_dir (one record per line in distributor.format), and one line per
batch in `manifest.jsonl` beside them. No network; always available.

Atomic and idempotent: the file is written to a temporary name, fsynced and renamed,
so a reader never sees half a batch (a failed write removes its temporary file, and
those of writers that died are swept when the target starts); the manifest line is
appended after the rename, and only when no earlier attempt got that far (then the file
already existed and the manifest is checked), so a redelivery leaves one file and one
manifest line.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Any

import orjson

from app import files
from app.config import JsonlTargetConfig
from app.db.types import utcnow
from app.errors import DeliveryError
from app.targets.base import Batch, Resources, SaveReceipt, TargetSpec

MANIFEST = "manifest.jsonl"
# A temporary batch file untouched this long is no write in progress (a batch is
# written in seconds, and its lease lasts workers.lease_seconds): it is swept at start.
STALE_TEMPORARY_SECONDS = 3600


class JsonlTarget:
    name = "jsonl"
    # A file per batch, the manifest appended to with one write each (app/targets/base.py).
    unordered = True

    def __init__(self, output_dir: str, fmt: str) -> None:
        self._dir = Path(output_dir)
        self._fmt = fmt

    async def deliver(self, batch: Batch, save: SaveReceipt) -> dict[str, Any]:
        # Serialising and fsyncing is blocking work: off the event loop.
        try:
            return await asyncio.to_thread(self._write, batch)
        except OSError as exc:  # a full disk, a directory we may not write
            raise DeliveryError(f"writing batch {batch.batch_id} to {self._dir}: {exc}") from exc

    def _write(self, batch: Batch) -> dict[str, Any]:
        files.make_dir(self._dir)
        path = self._dir / f"{batch.batch_id}.jsonl"
        records = batch.records(self._fmt)
        body = b"".join(orjson.dumps(record) + b"\n" for _, record in records)
        existed = path.exists()
        # A temporary name of its own: a worker whose lease expired may still be writing
        # the same batch.
        with files.replaced(path) as f:
            f.write(body)
        _fsync_dir(self._dir)
        entry = {
            "batch_id": batch.batch_id,
            "file": path.name,
            "format": self._fmt,
            "size": len(records),
            "bytes": len(body),
            "sha256": hashlib.sha256(body).hexdigest(),
            "created_at": batch.created_at.isoformat(),
            "written_at": utcnow().isoformat(),
            "trace_ids": [item.trace_id for item, _ in records],
            # Aligned with trace_ids: the hub's reward and the environment's own (null
            # when it sent none).
            "rewards": [item.reward for item, _ in records],
            "env_rewards": [item.env_reward for item, _ in records],
        }
        manifest = self._dir / MANIFEST
        if not (existed and _listed(manifest, batch.batch_id)):
            _append(manifest, orjson.dumps(entry) + b"\n")
        return {"file": str(path), "format": self._fmt, "bytes": len(body),
                "sha256": entry["sha256"]}


def _listed(manifest: Path, batch_id: str) -> bool:
    if not manifest.exists():
        return False
    needle = orjson.dumps(batch_id)
    with open(manifest, "rb") as f:
        return any(needle in line and orjson.loads(line).get("batch_id") == batch_id
                   for line in f)


def _append(path: Path, line: bytes) -> None:
    # O_APPEND with one write(): concurrent writers (several workers) never interleave.
    fd = files.create(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _build(config: JsonlTargetConfig, resources: Resources) -> JsonlTarget:
    # What writers killed mid-write left: a partial batch each.
    files.sweep_temporaries(config.output_dir, STALE_TEMPORARY_SECONDS)
    return JsonlTarget(config.output_dir, config.format)


SPEC = TargetSpec("jsonl", JsonlTargetConfig, _build)
