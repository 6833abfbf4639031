"""The Atropos domain's pure parts, without a server: batch formation, buffer
release, filled logprobs, stored segments, request limits; the tables against the
migration, and two hubs' transactions on them.
(tests/test_atropos_upstream.py checks formation against atroposlib itself.)"""

from __future__ import annotations

import asyncio
import gzip
import random
import zlib
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from pydantic import ValidationError

from app.atropos.logprobs import fill_inference_logprobs
from app.atropos.models import RegisterEnv, Registration, ScoredData
from app.atropos.packing import EnvShare, Item, form_batches, groups_summing_to
from app.atropos.segments import deflate, gzip_join, literal, plain_join
from app.atropos.tables import (
    ATROPOS_BATCHES,
    GROUPS,
    SEGMENTS,
    STATE,
    drop_served_groups,
    run_state,
)
from app.atropos.trainer_batches import _next_batch
from app.config import TraceServerConfig
from app.db import migrate
from app.db.engine import create_engine
from app.db.models import Base
from app.db.types import utcnow
from tests.support.databases import PG_ADMIN_URL
from tests.support.waiting import wait_until_async


def items(*sizes: int, env: int | None = 0) -> list[Item]:
    return [Item(i, env, size) for i, size in enumerate(sizes)]


def ids(batches: list[list[Item]]) -> list[list[int]]:
    return [[item.id for item in batch] for batch in batches]


def test_every_full_batch_is_formed_at_once() -> None:
    assert ids(form_batches(items(8, 8, 8, 8, 8), 16, [])) == [[0, 1], [2, 3]]


def test_smaller_groups_pack_to_the_largest_size() -> None:
    # Largest size 4: the 2s pack in pairs, in the order packs complete; the 3 never
    # packs (3 does not divide 4); the last 4 waits for the next batch.
    queue = items(2, 3, 4, 2, 4)
    assert ids(form_batches(queue, 8, [])) == [[2, 0, 3]]


def test_a_batch_that_would_overshoot_is_not_formed() -> None:
    assert form_batches(items(8, 8, 8), 12, []) == []


def test_minimum_allocation_comes_first() -> None:
    queue = [Item(0, 1, 2), Item(1, 1, 2), Item(2, 0, 2), Item(3, 1, 2)]
    envs = [EnvShare(0, True, 0.5), EnvShare(1, True, None)]
    assert ids(form_batches(queue, 4, envs)) == [[2, 0]]
    # An env owed a share with nothing queued: no batch at all.
    assert form_batches(queue[:2], 4, envs) == []
    # A disconnected env's minimum does not count.
    assert ids(form_batches(queue[:2], 4, [EnvShare(0, False, 0.5)])) == [[0, 1]]


def test_buffer_release_fifo_then_subset_sum() -> None:
    assert groups_summing_to([1, 1, 2], 2) == [0, 1]
    assert groups_summing_to([3, 2, 2], 4) == [1, 2]
    assert groups_summing_to([3, 3], 4) == []


def test_inference_logprobs_fill_prompt_with_1_and_the_rest_with_0() -> None:
    group = {"tokens": [[5, 6, 7], [8, 9]], "masks": [[-100, 6, 7], [-100]]}
    assert fill_inference_logprobs(group)["inference_logprobs"] == [
        [1.0, 0.0, 0.0],
        [1.0, 0.0],
    ]
    sent = {**group, "inference_logprobs": [[1.0, -0.5, -0.1], [1.0, -2.0]]}
    assert fill_inference_logprobs(sent) is sent


def test_stored_segments_splice_into_one_gzip_answer() -> None:
    """Groups deflated one by one, and constant pieces deflated once, join into the
    gzip stream (and the plain text) of their concatenation: what GET /batch sends."""
    rnd = random.Random(3)
    texts = [
        literal(b'{"batch":['),
        *(deflate(rnd.randbytes(rnd.randrange(0, 70_000)).hex().encode()) for _ in range(3)),
        literal(b"]}"),
    ]
    whole = b"".join(plain_join([t]) for t in texts)
    assert gzip.decompress(gzip_join(texts)) == whole == plain_join(texts)
    assert zlib.decompress(gzip_join(texts), 16 + zlib.MAX_WBITS) == whole
    assert gzip.decompress(gzip_join([])) == b""


@pytest.mark.parametrize(
    "model, body",
    [
        (Registration, {"batch_size": 0}),
        (Registration, {"batch_size": 2**40}),
        (Registration, {"wandb_group": "a\x00b"}),
        (Registration, {"checkpoint_dir": "\udc80"}),
        (RegisterEnv, {"group_size": 0}),
        (RegisterEnv, {"weight": float("inf")}),
        (ScoredData, {"env_id": 2**33}),
        (ScoredData, {"messages": [[{"role": "user"}]]}),
    ],
)
def test_what_cannot_be_served_or_stored_is_refused(model: Any, body: dict[str, Any]) -> None:
    valid = {
        Registration: {
            "wandb_group": "g",
            "wandb_project": "p",
            "batch_size": 8,
            "max_token_len": 512,
            "checkpoint_dir": "/c",
            "save_checkpoint_interval": 1,
            "starting_step": 0,
            "num_steps": 10,
        },
        RegisterEnv: {"max_token_length": 512, "desired_name": "e", "weight": 1, "group_size": 2},
        ScoredData: {"tokens": [[1]], "masks": [[1]], "scores": [1]},
    }[model]
    model.model_validate(valid)
    with pytest.raises(ValidationError):
        model.model_validate({**valid, **body})


async def test_the_tables_match_the_migration(trace_server: dict[str, Any]) -> None:
    engine = create_engine(TraceServerConfig(**trace_server))
    try:
        await migrate.upgrade(engine)
        async with engine.connect() as conn:
            diff = await conn.run_sync(
                lambda c: compare_metadata(MigrationContext.configure(c), Base.metadata)
            )
    finally:
        await engine.dispose()
    ours = [d for d in diff if "atropos_" in repr(d)]
    assert ours == []


@pytest.mark.skipif(not PG_ADMIN_URL, reason="needs PostgreSQL: SQLite has one writer")
@pytest.mark.parametrize("dialect", ["postgresql"])
async def test_two_hubs_serving_batches_at_once_take_turns(trace_server: dict[str, Any]) -> None:
    """One hub has formed batches (it holds the run row) and is deleting the groups
    served before, while another serves a batch formed earlier. The second used to
    delete those groups too, then wait for the run row to count them: a deadlock, and
    a GET /batch answered 503."""
    engine = create_engine(TraceServerConfig(**trace_server))
    try:
        await migrate.upgrade(engine)
        async with engine.begin() as conn:
            segments = (await conn.execute(
                sa.insert(SEGMENTS).returning(SEGMENTS.c.id),
                [{"deflated": deflate(b"{}").data, "crc32": 0}] * 6,
            )).scalars().all()
            now = utcnow()
            states = ["served"] * 3 + ["batched"] * 2 + ["queued"]
            groups = (await conn.execute(sa.insert(GROUPS).returning(GROUPS.c.id), [
                {"state": state, "env_id": 0, "size": 2, "bytes": 2, "fill_logprobs": False,
                 "segment_id": segment, "created_at": now}
                for state, segment in zip(states, segments, strict=True)
            ])).scalars().all()
            await conn.execute(sa.insert(ATROPOS_BATCHES).values(
                seq=1, state="pending", group_ids=groups[3:5], sequences=4, deliveries=0,
                created_at=now, updated_at=now,
            ))
            await conn.execute(sa.update(STATE).values(registered=True, started=True,
                                                       batch_size=4))
        async with engine.connect() as forming, engine.connect() as watcher:
            await forming.begin()
            await forming.run_sync(lambda c: run_state(c, lock=True))

            serving_pid: list[int] = []

            async def serve() -> Any:
                async with engine.begin() as conn:
                    serving_pid.append(await conn.scalar(sa.text("SELECT pg_backend_pid()")))
                    return await conn.run_sync(
                        lambda c: _next_batch(c, False, lease_seconds=60, env_timeout=60)
                    )

            serving = asyncio.create_task(serve())

            async def serving_waits() -> bool:
                waiting = "SELECT count(*) FROM pg_locks WHERE NOT granted AND pid = :pid"
                return bool(serving_pid) and bool(
                    await watcher.scalar(sa.text(waiting), {"pid": serving_pid[0]})
                )

            await wait_until_async(serving_waits, what="the serving hub to wait for a lock")
            await forming.run_sync(drop_served_groups)
            await forming.commit()
            stored, _ = await serving
        async with engine.connect() as conn:
            left = (await conn.execute(sa.select(GROUPS.c.state))).scalars().all()
            dropped = await conn.scalar(sa.select(STATE.c.groups_dropped))
        assert (len(stored), left, dropped) == (2, ["queued"], 5)
    finally:
        await engine.dispose()
