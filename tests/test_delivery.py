"""The delivery stage against a fake HTTP trainer on 127.0.0.1: a worker killed with
kill -9 mid-delivery loses nothing and its redelivery carries the same key; failures
retry with backoff; a target that keeps failing ends visibly failed and can be
re-queued."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from app.config import (
    DeliveryRetry,
    DistributorConfig,
    HttpTargetConfig,
    JsonlTargetConfig,
    TinkerConfig,
)
from app.db.models import BATCHES
from app.db.types import utcnow
from app.domain import Stage
from app.outage import Outage
from app.stages import delivery
from app.stages.delivery import DeliveryStage
from app.stages.distribution import DistributionStage
from app.stages.leases import Lease
from app.stages.runner import StageRunner
from app.targets import build_target
from app.targets.jsonl import JsonlTarget
from tests.support.databases import database
from tests.support.fakes.model_server import serve
from tests.support.fakes.trainer_server import FakeTrainer
from tests.support.hubs import InProcessHub
from tests.support.pipeline import ingest, set_rewards
from tests.support.processes import WorkerProcess, run_cli
from tests.support.waiting import wait_until, wait_until_async


@pytest.fixture
def trainer() -> Iterator[tuple[FakeTrainer, str]]:
    fake = FakeTrainer()
    with serve(fake) as root:
        yield fake, f"{root}/batches"


def sections(url: str, **retry: Any) -> dict[str, Any]:
    return {
        "distributor": {"target": "http", "url": url, "batch_size": 3,
                        "min_reward_threshold": 0,
                        "retry": {"base_seconds": 0.2, "max_seconds": 1, **retry}},
        "workers": {"lease_seconds": 2},
    }


def batches(client: httpx.Client) -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = client.get("/v1/batches").json()["batches"]
    return listed


@pytest.mark.process
async def test_kill_9_mid_delivery_redelivers_with_the_same_key(
    start_hub: Any, trace_server: dict[str, Any], trainer: tuple[FakeTrainer, str]
) -> None:
    fake, url = trainer
    fake.delay = 1.0  # every delivery is in flight for a second: time to kill the worker
    # An idle stage looks for work again after the flush interval: the restarted worker
    # finds the killed one's batches once their leases (2 s) have run out.
    hub: InProcessHub = start_hub({**trace_server, "flush_interval_seconds": 0.5},
                                  "--no-workers", **sections(url))
    ids = [f"k{i:02d}" for i in range(12)]
    with hub.client() as client:
        ingest(client, ids)
    await set_rewards(trace_server, {t: 10.0 for t in ids})

    worker = WorkerProcess(hub.config).start()
    try:
        wait_until(lambda: fake.requests, timeout=30, what="a delivery in flight")
        worker.kill()  # the trainer is still answering: the worker never hears it
        killed_key = fake.requests[0].key
        worker.start()
        with hub.client() as client:
            wait_until(lambda: [b["state"] for b in batches(client)] == ["delivered"] * 4,
                       timeout=60, what="every batch delivered")
            listed = batches(client)
    finally:
        worker.kill()

    # Every batch acknowledged by the trainer under its own id; no trace lost or twice.
    assert sorted(fake.accepted) == sorted(b["batch_id"] for b in listed)
    delivered = [t for ids_ in fake.accepted.values() for t in ids_]
    assert sorted(delivered) == ids
    # The killed delivery came again, with the same key and the same traces.
    again = [r for r in fake.requests if r.key == killed_key]
    assert len(again) >= 2
    assert all(r.batch_id == killed_key and r.trace_ids == again[0].trace_ids for r in again)
    assert all(r.encoding == "gzip" for r in fake.requests)
    killed = next(b for b in listed if b["batch_id"] == killed_key)
    assert killed["attempts"] >= 2
    assert {r.trace_ids[0] for r in fake.requests if r.key != killed_key} <= set(ids)


async def test_a_trainer_that_fails_twice_then_succeeds(
    start_hub: Any, trace_server: dict[str, Any], trainer: tuple[FakeTrainer, str]
) -> None:
    fake, url = trainer
    fake.failures = 2
    hub = start_hub(trace_server, "--no-workers", **sections(url))
    with hub.client() as client:
        ingest(client, ["a", "b", "c"])
        await set_rewards(trace_server, {"a": 1.0, "b": 2.0, "c": 3.0})
        hub.start_stages()  # as a worker started now would
        [batch] = wait_until(
            lambda: [b for b in batches(client) if b["state"] == "delivered"],
            timeout=30, what="the batch delivered")
    assert batch["attempts"] == 3 and "HTTP 503" in batch["last_error"]
    assert [r.key for r in fake.requests] == [batch["batch_id"]] * 3
    records = fake.requests[-1].records
    assert [(r["trace_id"], r["reward"]) for r in records] == [("a", 1.0), ("b", 2.0), ("c", 3.0)]
    assert all("messages" in r for r in records)  # distributor.format: openai by default
    assert "retrying in" in hub.log


@pytest.mark.process
async def test_a_target_that_keeps_failing_ends_failed_and_can_be_retried(
    start_hub: Any, trace_server: dict[str, Any], trainer: tuple[FakeTrainer, str]
) -> None:
    fake, url = trainer
    fake.always_fail = True
    # A short flush interval: the stages poll for the re-queued batch (no wake-up
    # reaches them from the `atropos batches retry` process).
    hub = start_hub(trace_server | {"flush_interval_seconds": 0.5}, "--no-workers",
                    **sections(url, max_attempts=3))
    with hub.client() as client:
        ingest(client, ["x", "y", "z"])
        await set_rewards(trace_server, {"x": 1.0, "y": 1.0, "z": 1.0})
        hub.start_stages()  # as a worker started now would
        [failed] = wait_until(lambda: [b for b in batches(client) if b["state"] == "failed"],
                              timeout=30, what="the batch failed")
        assert failed["attempts"] == 3 and "HTTP 503" in failed["last_error"]
        assert client.get("/v1/stats").json()["batches"]["failed"] == 1
        assert client.get("/v1/traces/x").json()["stage"] == "batched"
        assert "giving up" in hub.log and "atropos batches retry" in hub.log

        listed = run_cli("batches", "list", "--state", "failed", "--config", str(hub.config))
        assert listed.returncode == 0, listed.stderr
        [line] = listed.stdout.splitlines()
        assert line.startswith(f"{failed['batch_id']}  failed") and "HTTP 503" in line

        fake.always_fail = False
        done = run_cli("batches", "retry", "--all-failed", "--config", str(hub.config))
        assert done.returncode == 0, done.stderr
        assert done.stdout.split("\n")[:2] == ["1 failed batches are pending again",
                                                f"  {failed['batch_id']}"]
        wait_until(lambda: batches(client)[0]["state"] == "delivered", timeout=60,
                   what="the retried batch delivered")
        assert client.get("/v1/traces/x").json()["stage"] == "delivered"
        again = run_cli("batches", "retry", failed["batch_id"], "--config", str(hub.config))
        assert again.returncode == 1 and "not failed" in again.stderr
        assert client.post(f"/v1/batches/{failed['batch_id']}/retry").status_code == 409


def test_backoff_first_within_5_s_then_growing_to_at_most_a_minute() -> None:
    retry = DistributorConfig().retry
    ceilings = [max(retry.delay(n) for _ in range(200)) for n in range(1, 10)]
    assert ceilings[0] <= 5 and all(c <= 60 for c in ceilings)
    assert ceilings[5] > 30  # it does grow towards the cap
    assert min(retry.delay(1) for _ in range(200)) >= 2.5


async def test_a_directory_that_cannot_be_written_fails_the_batch_in_one_line(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Any
) -> None:
    # The jsonl target's OSError is translated where the target writes (a DeliveryError,
    # one of the services the hub calls): the batch says why, and no traceback is logged.
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    hub = start_hub(trace_server, "--no-workers",
                    distributor={"target": "jsonl", "output_dir": str(blocker / "batches"),
                                 "batch_size": 3, "min_reward_threshold": 0,
                                 "retry": {"max_attempts": 1}})
    with hub.client() as client:
        ingest(client, ["x", "y", "z"])
        await set_rewards(trace_server, {"x": 1.0, "y": 1.0, "z": 1.0})
        hub.start_stages()
        [failed] = wait_until(lambda: [b for b in batches(client) if b["state"] == "failed"],
                              timeout=30, what="the batch failed")
    assert failed["last_error"].startswith("DeliveryError: writing batch ")
    assert str(blocker) in failed["last_error"]
    assert "Traceback" not in hub.log and "giving up" in hub.log


async def test_a_jsonl_pass_hands_over_its_batches_at_once_each_failing_alone(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    """The jsonl target is Unordered: the batches of a pass are written together, and the
    one whose file cannot be written fails alone; those after it are delivered."""
    out = tmp_path / "batches"
    config = JsonlTargetConfig(output_dir=str(out), batch_size=3, min_reward_threshold=0,
                               retry=DeliveryRetry(max_attempts=1))
    ids = [f"u{i}" for i in range(9)]
    hub = await _holding(start_hub, trace_server, config, ids)
    with hub.client() as client:
        async with database(trace_server) as engine:
            formed = await _formed(engine, config)
        assert len(formed) == 3
        (out / f"{formed[0]}.jsonl").mkdir(parents=True)  # no file can take its place
        hub.drain()
        states = {b["batch_id"]: b["state"] for b in batches(client)}
    assert states == {formed[0]: "failed", formed[1]: "delivered", formed[2]: "delivered"}
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(m["batch_id"] for m in manifest) == sorted(formed[1:])


async def test_a_jsonl_pass_that_fails_or_dies_after_its_files_lists_each_batch_once(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    """The manifest is the record of what was delivered, appended once per pass after
    the pass's files. A pass that fails between its files and the manifest, and one that
    wrote both but died before its acknowledgement, are delivered again: one file and
    one manifest line per batch, holding its traces."""
    out = tmp_path / "batches"
    config = JsonlTargetConfig(output_dir=str(out), batch_size=3, min_reward_threshold=0)
    ids = [f"m{i}" for i in range(12)]
    hub = await _holding(start_hub, trace_server, config, ids)
    with hub.client() as client:
        async with database(trace_server) as engine:
            formed = await _formed(engine, config)
            assert len(formed) == 4
            # Killed after the manifest, before the acknowledgement: the target wrote the
            # last batch's file and its line, the database still has it pending.
            target = JsonlTarget(str(out), config.format)
            [file] = await _files(engine, config, formed[3:])
            assert not isinstance((await target.write_files([file]))[0], Exception)
            # Failing between the files and the manifest: no manifest can be appended.
            (out / "manifest.jsonl.tmp").write_bytes((out / "manifest.jsonl").read_bytes())
            (out / "manifest.jsonl").unlink()
            (out / "manifest.jsonl").mkdir()
            hub.drain()
            states = {b["batch_id"]: b["state"] for b in batches(client)}
            assert set(states.values()) == {"pending"}
            assert sorted(p.name for p in out.glob("b-*.jsonl")) == sorted(
                f"{b}.jsonl" for b in formed)
            (out / "manifest.jsonl").rmdir()
            (out / "manifest.jsonl.tmp").rename(out / "manifest.jsonl")
            async with engine.begin() as conn:  # their backoff has passed
                await conn.execute(sa.update(BATCHES).values(lease_expires_at=utcnow()))
        hub.drain()
        listed = {b["batch_id"]: b for b in batches(client)}
    assert {b["state"] for b in listed.values()} == {"delivered"}
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(m["batch_id"] for m in manifest) == sorted(formed)
    for line in manifest:
        records = (out / line["file"]).read_text().splitlines()
        assert len(records) == len(line["trace_ids"]) == 3
        assert line["sha256"] == listed[line["batch_id"]]["receipt"]["sha256"]
    assert sorted(t for m in manifest for t in m["trace_ids"]) == sorted(ids)


@pytest.mark.process
async def test_a_jsonl_pass_of_large_traces_is_written_in_parts_each_batch_once(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pass holds its batches' payloads and files at once: past TOKENS_PER_PART (here
    every batch) it writes them in parts, and still delivers and lists each batch once,
    its traces in order."""
    out = tmp_path / "batches"
    config = JsonlTargetConfig(output_dir=str(out), batch_size=3, min_reward_threshold=0)
    ids = [f"p{i}" for i in range(9)]
    hub = await _holding(start_hub, trace_server, config, ids)
    with hub.client() as client:
        monkeypatch.setattr(delivery, "TOKENS_PER_PART", 1)
        async with database(trace_server) as engine:
            assert len(await _formed(engine, config)) == 3
            stage = DeliveryStage(engine, JsonlTarget(str(out), config.format), config,
                                  lease=Lease(30))
            assert await stage.run_once() == 3
        listed = {b["batch_id"]: b for b in batches(client)}
    assert {b["state"] for b in listed.values()} == {"delivered"}
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(m["batch_id"] for m in manifest) == sorted(listed)
    for line in manifest:
        batch = line["trace_ids"]
        records = (out / line["file"]).read_text().splitlines()
        assert len(records) == len(batch) == 3
        assert line["sha256"] == listed[line["batch_id"]]["receipt"]["sha256"]
        assert batch == sorted(batch, key=ids.index)  # in the order they were batched
    assert sorted(t for m in manifest for t in m["trace_ids"]) == sorted(ids)


async def _holding(start_hub: Any, trace_server: dict[str, Any], config: JsonlTargetConfig,
                   ids: list[str]) -> Any:
    """A hub, its stages off, holding the traces `ids`, each rewarded 1.0."""
    hub = start_hub(trace_server, "--no-workers", distributor=config.model_dump(mode="json"))
    with hub.client() as client:
        ingest(client, ids)
    await set_rewards(trace_server, {t: 1.0 for t in ids})
    return hub


async def _formed(engine: Any, config: JsonlTargetConfig) -> list[str]:
    """A distribution pass over the traces stored: the batches' ids, oldest first."""
    await DistributionStage(engine, config).run_once()
    async with engine.connect() as conn:
        return list((await conn.execute(
            sa.select(BATCHES.c.batch_id).order_by(BATCHES.c.created_at))).scalars())


async def _files(engine: Any, config: JsonlTargetConfig, batch_ids: list[str]) -> list[Any]:
    """The batches' files as delivery renders them."""
    from app.db.models import MEMBERS, PAYLOADS, TRACES
    from app.targets.base import render_file

    files = []
    async with engine.connect() as conn:
        for batch_id in batch_ids:
            created_at = (await conn.execute(sa.select(BATCHES.c.created_at).where(
                BATCHES.c.batch_id == batch_id))).scalar_one()
            members = (await conn.execute(
                sa.select(TRACES.c.trace_id, TRACES.c.reward,
                          sa.cast(PAYLOADS.c.trace, sa.Text))
                .join(PAYLOADS, PAYLOADS.c.trace_id == TRACES.c.trace_id)
                .join(MEMBERS, MEMBERS.c.trace_id == TRACES.c.trace_id)
                .where(MEMBERS.c.batch_id == batch_id).order_by(MEMBERS.c.position))).all()
            files.append(render_file(batch_id, created_at,
                                     [(t, r, p, False) for t, r, p in members], config.format))
    return files


async def test_a_batch_whose_lease_ran_out_mid_delivery_is_acknowledged_once_by_its_new_owner(
    start_hub: Any, trace_server: dict[str, Any], trainer: tuple[FakeTrainer, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A pass's acknowledgement moves only the batches its lease still holds: the worker
    whose lease ran out while the trainer answered leaves the batch to its new owner."""
    fake, url = trainer
    fake.delay = 1.0  # the first delivery is in flight while its lease runs out
    hub: InProcessHub = start_hub(trace_server, "--no-workers", **sections(url))
    ids = ["l0", "l1", "l2"]
    with hub.client() as client:
        ingest(client, ids)
    await set_rewards(trace_server, {t: 10.0 for t in ids})
    config = HttpTargetConfig(url=url, batch_size=3, min_reward_threshold=0)
    async with database(trace_server) as engine, httpx.AsyncClient() as http:
        await DistributionStage(engine, config).run_once()
        target = build_target(config, TinkerConfig(), http)
        first, second = (DeliveryStage(engine, target, config, lease=Lease()) for _ in "ab")
        slow = asyncio.create_task(first.run_once())
        await wait_until_async(lambda: fake.requests, what="the first delivery in flight")
        async with engine.begin() as conn:
            await conn.execute(sa.update(BATCHES).values(lease_expires_at=utcnow()))
        assert await second.run_once() == 1
        assert await slow == 1
        async with engine.connect() as conn:
            row = (await conn.execute(sa.select(BATCHES))).one()
    assert (row.state, row.attempts, row.lease_owner) == ("delivered", 2, None)
    assert [len(ids_) for ids_ in fake.accepted.values()] == [3]
    assert "delivered, but the lease was lost first" in caplog.text


async def test_a_pass_that_formed_fewer_batches_than_it_may_is_not_run_again_at_once(
    start_hub: Any, trace_server: dict[str, Any], tmp_path: Path
) -> None:
    """Distribution takes all there is in one pass (batches of the eligible traces, up
    to its most): the traces left over make no batch, so the next pass waits for a
    wake-up (an ingest commit) rather than pay a write turn at once for nothing."""
    config = JsonlTargetConfig(output_dir=str(tmp_path / "out"), batch_size=2,
                               min_reward_threshold=0)
    ids = ["p0", "p1", "p2"]
    await _holding(start_hub, trace_server, config, ids)
    async with database(trace_server) as engine:
        stage = DistributionStage(engine, config)
        woken = False
        passes: list[bool] = []  # for each pass: whether it began after the wake-up
        formed: list[int] = []  # what each pass advanced
        run_once = stage.run_once

        async def counted() -> int:
            passes.append(woken)
            formed.append(await run_once())
            return formed[-1]

        stage.run_once = counted  # type: ignore[method-assign]
        runner = StageRunner(flush_interval=3600, outage=Outage("the database", "nothing"))
        runner.add(stage)
        runner.start()
        try:
            await wait_until_async(lambda: formed, what="the first pass")
            woken = True
            runner.take_on([Stage.COMPRESSION_SKIPPED.value])
            await wait_until_async(lambda: woken in passes and len(formed) == len(passes),
                                   what="the pass woken")
        finally:
            await runner.stop()
    assert passes == [False, True]
    assert formed == [2, 0]  # one batch; the trace left over makes none
