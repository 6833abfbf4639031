"""The distribution stage: exact, disjoint, oldest-first batches of passing traces;
the schema's guarantee; the batch API and stats; the jsonl target's files."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from app.db.models import BATCHES, MEMBERS
from app.db.types import utcnow
from tests.support.databases import database
from tests.support.hubs import InProcessHub
from tests.support.pipeline import ingest, set_rewards
from tests.support.processes import run_cli

THRESHOLD = 5.0


def distributor(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    return {"target": "jsonl", "batch_size": 4, "min_reward_threshold": THRESHOLD,
            "output_dir": str(tmp_path / "batches"), **overrides}


async def test_batches_exact_oldest_first_above_threshold(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    hub = start_hub(trace_server, "--no-workers", distributor=distributor(tmp_path))
    ids = [f"t{i:02d}" for i in range(16)]
    # Every third trace fails the threshold; exactly at the threshold passes (inclusive).
    rewards = {t: (THRESHOLD - 0.5 if i % 3 == 2 else THRESHOLD + (i % 2)) for i, t in enumerate(ids)}
    passing = [t for t in ids if rewards[t] >= THRESHOLD]
    assert len(passing) == 11
    with hub.client() as client:
        ingest(client, ids)
        await set_rewards(trace_server, rewards)
        hub.drain()  # as `atropos worker --burst` would

        listed = client.get("/v1/batches").json()["batches"]
        assert len(listed) == 2  # 11 passing traces: two full batches, three waiting
        batches = [client.get(f"/v1/batches/{b['batch_id']}").json() for b in reversed(listed)]
        assert [b["trace_ids"] for b in batches] == [passing[0:4], passing[4:8]]
        for b in batches:
            assert b["state"] == "delivered" and b["attempts"] == 1 and b["last_error"] is None
            assert b["size"] == 4 and b["target"] == "jsonl"
        stages = {t: client.get(f"/v1/traces/{t}").json()["stage"] for t in ids}
        assert {t for t, s in stages.items() if s == "below_threshold"} == set(ids) - set(passing)
        assert {t for t, s in stages.items() if s == "delivered"} == set(passing[:8])
        assert all(stages[t] in ("compressed", "compression_skipped") for t in passing[8:])

        # One more passing trace completes the third batch, from the oldest waiting ones.
        ingest(client, ["t16"])
        await set_rewards(trace_server, {"t16": 9.0})
        hub.drain()
        newest = client.get("/v1/batches?limit=1").json()["batches"][0]
        third = client.get(f"/v1/batches/{newest['batch_id']}").json()
        assert third["trace_ids"] == passing[8:] + ["t16"]

        stats = client.get("/v1/stats").json()
        assert stats["batches"] == {"pending": 0, "delivered": 3, "failed": 0, "total": 3}
        metrics = client.get("/metrics").text
        assert 'atropos_batches{state="delivered"} 3' in metrics


async def test_jsonl_target_writes_files_and_manifest(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "batches"
    hub = start_hub(trace_server, "--no-workers",
                    distributor=distributor(tmp_path, format="sharegpt", batch_size=3))
    ids = [f"j{i}" for i in range(6)]
    with hub.client() as client:
        ingest(client, ids)
        await set_rewards(trace_server, {t: 10.0 for t in ids})
        hub.drain()
        listed = client.get("/v1/batches").json()["batches"]
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(m["batch_id"] for m in manifest) == sorted(b["batch_id"] for b in listed)
    for entry in manifest:
        lines = (out / entry["file"]).read_text().splitlines()
        assert len(lines) == entry["size"] == 3 and entry["format"] == "sharegpt"
        assert all("conversations" in json.loads(line) for line in lines)
    assert [t for m in sorted(manifest, key=lambda m: m["created_at"]) for t in m["trace_ids"]] == ids
    assert not list(out.glob(".*.tmp"))  # written atomically: no temporary left behind


@pytest.mark.process
async def test_concurrent_distributors_never_share_a_trace(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    hub = start_hub(trace_server, "--no-workers", distributor=distributor(tmp_path, batch_size=5))
    ids = [f"c{i:03d}" for i in range(60)]
    with hub.client() as client:
        r = client.post("/v1/traces", json={"traces": [{"trace_id": t, "task": "t", "steps": [
            {"type": "final", "content": "done"}], "outcome": {"status": "success"}}
            for t in ids]})
        assert r.status_code == 207
    await set_rewards(trace_server, {t: 10.0 for t in ids})
    runs = await asyncio.gather(*(
        asyncio.to_thread(run_cli, "worker", "--config", str(hub.config), "--burst")
        for _ in range(3)
    ))
    assert all(run.returncode == 0 for run in runs), [run.stderr for run in runs]
    async with database(trace_server) as engine, engine.connect() as conn:
        members = (await conn.execute(sa.select(MEMBERS))).all()
        sizes = (await conn.execute(sa.select(BATCHES.c.size))).scalars().all()
    assert sorted(m.trace_id for m in members) == ids  # every trace once, none twice
    assert sizes == [5] * 12
    seen: list[str] = []
    cursor: str | None = None
    with hub.client() as client:
        while True:
            params = {"limit": 5, **({"cursor": cursor} if cursor else {})}
            page = client.get("/v1/batches", params=params).json()
            seen += [b["batch_id"] for b in page["batches"]]
            if not (cursor := page["next_cursor"]):
                break
    assert len(seen) == len(set(seen)) == 12


async def test_schema_refuses_a_trace_in_two_batches(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    hub = start_hub(trace_server, "--no-workers", distributor=distributor(tmp_path))
    with hub.client() as client:
        ingest(client, ["only"])
    async with database(trace_server) as engine:
        now = utcnow()
        async with engine.begin() as conn:
            for batch_id in ("b1", "b2"):
                await conn.execute(sa.insert(BATCHES).values(
                    batch_id=batch_id, created_at=now, updated_at=now, size=1, target="jsonl",
                    format="openai", state="pending", attempts=0))
            await conn.execute(sa.insert(MEMBERS).values(
                trace_id="only", batch_id="b1", position=0))
        with pytest.raises(IntegrityError):
            async with engine.begin() as conn:
                await conn.execute(sa.insert(MEMBERS).values(
                    trace_id="only", batch_id="b2", position=0))


def test_unknown_batch_is_a_json_404(hub: InProcessHub) -> None:
    with hub.client() as client:
        r = client.get("/v1/batches/nope")
        assert r.status_code == 404 and r.json()["error"]["field"] == "batch_id"
        assert client.get("/v1/batches?state=bogus").status_code == 422


def _write_under_a_file_size_limit(out: str, limit: int) -> str:
    """In a process of its own: the jsonl target writes a batch larger than the files
    it may write (RLIMIT_FSIZE: the kernel fails the write part-way, as on a full
    disk); returns the error it raised."""
    import resource

    from app.errors import DeliveryError
    from app.formats import parse
    from app.targets.base import Batch, BatchItem
    from app.targets.jsonl import JsonlTarget

    trace = parse({"messages": [{"role": "user", "content": "x" * 4 * limit},
                                {"role": "assistant", "content": "done"}]})
    batch = Batch("b-full", utcnow(), 1, [BatchItem("t-1", 1.0, trace, False)], {})
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        asyncio.run(JsonlTarget(out, "openai").deliver(batch, lambda _: asyncio.sleep(0)))
    except DeliveryError as exc:  # the target's OSError, translated where it writes
        return type(exc.__cause__).__name__
    return "written"


def test_a_failed_batch_file_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    out = tmp_path / "batches"
    out.mkdir()
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        for _ in range(3):  # each attempt as the delivery stage retries it
            assert pool.apply(_write_under_a_file_size_limit, (str(out), 64 * 1024)) != "written"
    assert sorted(p.name for p in out.iterdir()) == []


def test_stale_temporary_batch_files_are_swept_at_start(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    """A worker killed mid-write left a partial batch: gone when the hub starts; one
    being written now (by another process sharing the directory) is left alone, and so
    is anything that is not a temporary batch file."""
    out = tmp_path / "batches"
    out.mkdir()
    stale = out / ".b-1.jsonl.0123456789abcdef.tmp"
    fresh = out / ".b-2.jsonl.fedcba9876543210.tmp"
    mine = out / "notes.tmp"
    for path in (stale, fresh, mine):
        path.write_bytes(b'{"partial": ')
    hours_ago = time.time() - 2 * 3600
    for path in (stale, mine):
        os.utime(path, (hours_ago, hours_ago))
    start_hub(trace_server, distributor=distributor(tmp_path))
    assert sorted(p.name for p in out.iterdir()) == sorted([fresh.name, mine.name])
