"""The `jsonl` target: one training file per batch, `<batch_id>.jsonl` in
distributor.output_dir (one record per line in distributor.format), and one line per
batch in `manifest.jsonl` beside them. No network; always available.

Atomic and idempotent: the file is written to a temporary name, fsynced and renamed,
so a reader never sees half a batch (a failed write removes its temporary file, and
those of writers that died are swept when the target starts). The files of a delivery
pass are written at once; then the directory is fsynced and their manifest lines are
appended in one write, each only when no earlier attempt got that far (then the file
already existed and the manifest is checked), so a redelivery leaves one file and one
manifest line. The manifest is the record of what was delivered: a hub killed
mid-pass, before the batches' acknowledgement, delivers them again, and each gets its
line then if it had none.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import orjson

from app import files
from app.config import JsonlTargetConfig
from app.db.types import utcnow
from app.errors import DeliveryError
from app.targets.base import Batch, BatchFile, Resources, SaveReceipt, TargetSpec

MANIFEST = "manifest.jsonl"
# A temporary batch file untouched this long is no write in progress (a batch is
# written in seconds, and its lease lasts workers.lease_seconds): it is swept at start.
STALE_TEMPORARY_SECONDS = 3600


class JsonlTarget:
    name = "jsonl"

    def __init__(self, output_dir: str, fmt: str) -> None:
        self._dir = Path(output_dir)
        self.fmt = fmt

    async def deliver(self, batch: Batch, save: SaveReceipt) -> dict[str, Any]:
        file = BatchFile.of(batch.batch_id, batch.created_at, batch.items, self.fmt)
        file.say_left_out()
        [receipt] = await self.write_files([file])
        if isinstance(receipt, Exception):
            raise receipt
        return receipt

    async def write_files(self, files: list[BatchFile]) -> list[dict[str, Any] | Exception]:
        """Each file written (to a temporary name, fsynced, renamed) in a thread of its
        own, so that their fsyncs overlap; then, once for all, the directory fsynced and
        the manifest's lines appended in one write (blocking work: off the event loop)."""
        written = await asyncio.gather(*(asyncio.to_thread(self._write, f) for f in files),
                                       return_exceptions=True)
        done = [(f, existed) for f, existed in zip(files, written, strict=True)
                if isinstance(existed, bool)]
        listed: OSError | None = None
        if done:
            try:
                await asyncio.to_thread(self._list, done)
            except OSError as exc:
                listed = exc
        receipts: list[dict[str, Any] | Exception] = []
        for f, outcome in zip(files, written, strict=True):
            failure = outcome if isinstance(outcome, BaseException) else listed
            if isinstance(failure, OSError):  # a full disk, a directory we may not write
                error = DeliveryError(f"writing batch {f.batch_id} to {self._dir}: {failure}")
                error.__cause__ = failure
                receipts.append(error)
            elif isinstance(failure, Exception):
                receipts.append(failure)
            elif failure is not None:
                raise failure
            else:
                receipts.append({"file": str(self._dir / _name(f)), "format": f.fmt,
                                 "bytes": len(f.body), "sha256": f.sha256})
        return receipts

    def _write(self, file: BatchFile) -> bool:
        """The batch's file in place; whether one was there already (an earlier
        attempt's)."""
        files.make_dir(self._dir)
        path = self._dir / _name(file)
        existed = path.exists()
        # A temporary name of its own: a worker whose lease expired may still be writing
        # the same batch.
        with files.replaced(path) as f:
            f.write(file.body)
        return existed

    def _list(self, written: list[tuple[BatchFile, bool]]) -> None:
        """The renames made durable, then a manifest line for each file that no earlier
        attempt listed (one whose file existed may have been)."""
        _fsync_dir(self._dir)
        manifest = self._dir / MANIFEST
        listed = _listed(manifest, {f.batch_id for f, existed in written if existed})
        now = utcnow().isoformat()
        lines = [orjson.dumps({
            "batch_id": f.batch_id,
            "file": _name(f),
            "format": f.fmt,
            "size": len(f.trace_ids),
            "bytes": len(f.body),
            "sha256": f.sha256,
            "created_at": f.created_at.isoformat(),
            "written_at": now,
            "trace_ids": f.trace_ids,
            # Aligned with trace_ids: the hub's reward and the environment's own (null
            # when it sent none).
            "rewards": f.rewards,
            "env_rewards": f.env_rewards,
        }) + b"\n" for f, _ in written if f.batch_id not in listed]
        if lines:
            _append(manifest, b"".join(lines))


def _name(file: BatchFile) -> str:
    return f"{file.batch_id}.jsonl"


def _listed(manifest: Path, batch_ids: set[str]) -> set[str]:
    """Those of `batch_ids` that the manifest lists already."""
    if not batch_ids or not manifest.exists():
        return set()
    needles = [orjson.dumps(batch_id) for batch_id in batch_ids]
    found = set()
    with open(manifest, "rb") as f:
        for line in f:
            if any(needle in line for needle in needles):
                batch_id = orjson.loads(line).get("batch_id")
                if batch_id in batch_ids:
                    found.add(batch_id)
    return found


def _append(path: Path, lines: bytes) -> None:
    # O_APPEND with one write(): concurrent writers (several workers) never interleave.
    fd = files.create(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, lines)
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
