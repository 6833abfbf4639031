"""State changes go through their transition table (app/db/moves.py): a move the table
does not allow is refused, on both databases."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from app.atropos.tables import (
    ATROPOS_BATCH_STATES,
    GROUP_STATES,
    AtroposBatchState,
    AtroposGroupState,
)
from app.db.batch_queries import retry_batch
from app.db.models import BATCHES, TRACES
from app.db.moves import BATCH_STATES, TRACE_STAGES, ForbiddenMove, StateMachine
from app.db.types import utcnow
from app.domain import BatchState, Stage
from app.errors import Conflict
from app.ingest.otlp.store import TRACE_STATES
from app.runs import records
from app.runs.records import RUN_STATUSES, RunStatus
from tests.support.pipeline import insert_trace, migrated, stages

MACHINES: list[StateMachine[Any]] = [
    TRACE_STAGES, BATCH_STATES, RUN_STATUSES, GROUP_STATES, ATROPOS_BATCH_STATES, TRACE_STATES
]


async def test_a_trace_moves_only_where_its_stage_allows(trace_server: dict[str, Any]) -> None:
    async with migrated(trace_server) as engine:
        for stage in (Stage.REJECTED, Stage.BATCHED, Stage.DELIVERED):
            await insert_trace(engine, f"was-{stage}", stage)
        # Asked for by name, a forbidden move is refused before anything is written.
        with pytest.raises(ForbiddenMove, match="trace delivered -> accepted"):
            TRACE_STAGES.move(Stage.ACCEPTED, expected=[Stage.DELIVERED])

        # Asked for every trace, it moves only those whose stage allows it.
        async with engine.begin() as conn:
            moved = await conn.execute(
                TRACE_STAGES.move(Stage.ACCEPTED).where(TRACES.c.trace_id.like("was-%"))
            )
        assert moved.rowcount == 1
        assert await stages(engine) == {
            "was-rejected": "accepted", "was-batched": "batched", "was-delivered": "delivered"
        }


async def test_a_delivered_batch_is_never_pending_again(trace_server: dict[str, Any]) -> None:
    async with migrated(trace_server) as engine:
        now = utcnow()
        async with engine.begin() as conn:
            await conn.execute(sa.insert(BATCHES).values(
                batch_id="b-1", created_at=now, updated_at=now, size=1, target="jsonl",
                format="openai", state=BATCH_STATES.enter(BatchState.PENDING), attempts=1,
            ))
            await conn.execute(
                BATCH_STATES.move(BatchState.DELIVERED, expected=[BatchState.PENDING])
                .where(BATCHES.c.batch_id == "b-1")
            )
        with pytest.raises(ForbiddenMove):
            BATCH_STATES.move(BatchState.PENDING, expected=[BatchState.DELIVERED])
        async with engine.begin() as conn:
            again = await conn.execute(
                BATCH_STATES.move(BatchState.PENDING).where(BATCHES.c.batch_id == "b-1")
            )
        assert again.rowcount == 0
        # What `atropos batches retry` and POST /v1/batches/{id}/retry answer.
        with pytest.raises(Conflict, match="b-1 is delivered, not failed"):
            await retry_batch(engine, "b-1")


async def test_a_finished_run_does_not_move(trace_server: dict[str, Any]) -> None:
    async with migrated(trace_server) as engine, engine.begin() as conn:
        await records.create_run(conn, "r-1", {}, [("trainer", ["true"], "t.log")],
                                 host="h", supervisor="s")
        for status in (RunStatus.STARTING, RunStatus.RUNNING, RunStatus.COMPLETED):
            assert await records.move(conn, "r-1", status)
        assert not await records.move(conn, "r-1", RunStatus.FAILED)
        with pytest.raises(ForbiddenMove, match="run completed -> running"):
            await records.move(conn, "r-1", RunStatus.RUNNING, expected=[RunStatus.COMPLETED])
        assert await records.status_of(conn, "r-1") is RunStatus.COMPLETED


def test_atropos_moves_are_checked_by_the_same_tables() -> None:
    with pytest.raises(ForbiddenMove, match="Atropos batch acked -> pending"):
        ATROPOS_BATCH_STATES.move(AtroposBatchState.PENDING, expected=[AtroposBatchState.ACKED])
    with pytest.raises(ForbiddenMove, match="no Atropos group state may move to buffered"):
        GROUP_STATES.move(AtroposGroupState.BUFFERED)


def test_a_new_row_starts_only_in_an_entry_state() -> None:
    assert TRACE_STAGES.enter(Stage.REJECTED) == "rejected"
    with pytest.raises(ForbiddenMove, match="not an entry state"):
        TRACE_STAGES.enter(Stage.DELIVERED)
    with pytest.raises(ForbiddenMove):
        BATCH_STATES.enter(BatchState.DELIVERED)


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name)
def test_every_state_is_reachable_from_an_entry(machine: StateMachine[Any]) -> None:
    reached = set(machine.entries)
    frontier = list(reached)
    while frontier:
        for target in machine.moves[frontier.pop()]:
            if target not in reached:
                reached.add(target)
                frontier.append(target)
    # `received` is where a trace is before it is stored: never a row's stage.
    assert set(machine.moves) - reached <= {Stage.RECEIVED}
