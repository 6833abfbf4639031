"""The assembly tables (app/db/assembly.py): OTLP traces and gateway rollouts settle the
same way, on both databases: a row that received parts meanwhile stays open, and due;
parts that come once the trajectory was batched are counted late."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db.assembly import AssemblyTable, Due, Settled
from app.db.dialect import dialect_of
from app.db.types import utcnow
from app.gateway.store import ROLLOUT_ASSEMBLY
from app.ingest.otlp.store import TRACE_ASSEMBLY
from tests.support.pipeline import migrated

# Each table's own columns, as its writer fills them for a new part.
TABLES: dict[str, tuple[AssemblyTable[Any], dict[str, Any]]] = {
    "otlp_traces": (TRACE_ASSEMBLY, {"root_ended": True}),
    "gateway_rollouts": (ROLLOUT_ASSEMBLY, {"calls": 1, "finished": True, "finish": None}),
}


async def _arrive(engine: AsyncEngine, table: AssemblyTable[Any], own: dict[str, Any],
                  parts: dict[str, int]) -> None:
    """New parts for these rows, as their writers store them (the rows opened)."""
    now = utcnow() - timedelta(hours=1)  # quiet for long: every open row is due
    async with engine.begin() as conn:
        statement = table.reopen(dialect_of(conn))
        await conn.execute(statement, [{**table.opened(row, n, now), **own}
                                       for row, n in parts.items()])


async def _rows(engine: AsyncEngine, table: AssemblyTable[Any]) -> dict[str, tuple[Any, ...]]:
    """id -> (state, parts, seen, late, error)."""
    async with engine.connect() as conn:
        rows = await conn.execute(sa.select(table.id, table.states.column, table.parts,
                                            table.seen, table.late, table.table.c.error))
        return {row[0]: tuple(row[1:]) for row in rows}


@pytest.mark.parametrize("name", list(TABLES))
async def test_a_row_settles_unless_parts_came_meanwhile(
    trace_server: dict[str, Any], name: str
) -> None:
    table, own = TABLES[name]
    async with migrated(trace_server) as engine:
        await _arrive(engine, table, own, {"made": 2, "busy": 2, "bad": 1, "batched": 2})
        async with engine.connect() as conn:
            due = await table.due(conn, sa.true(), limit=10)
        assert sorted(due, key=lambda d: d.id) == [
            Due("bad", 1), Due("batched", 2), Due("busy", 2), Due("made", 2)]
        await _arrive(engine, table, own, {"busy": 1})  # while the assembly works
        settled = table.settled(due, {"made": ("new", None), "busy": ("new", None),
                                      "bad": ("refused", "no turn"), "batched": ("new", None)})
        async with engine.begin() as conn:
            await table.settle(conn, settled)
        assert await _rows(engine, table) == {
            "made": (table.assembled.value, 2, 2, 0, None),
            "busy": ("open", 3, 2, 0, None),
            "bad": (table.refused.value, 1, 1, 0, "no turn"),
            "batched": (table.assembled.value, 2, 2, 0, None),
        }
        async with engine.connect() as conn:
            assert await table.due(conn, sa.true(), limit=10) == [Due("busy", 3)]

        # Two parts for a trajectory batched meanwhile: kept, and counted late once.
        await _arrive(engine, table, own, {"batched": 2})
        async with engine.connect() as conn:
            (again,) = await table.due(conn, sa.true(), limit=10, exclude=["busy"])
        assert again == Due("batched", 4)
        async with engine.begin() as conn:
            await table.settle(conn, table.settled([again], {"batched": ("late", None)}))
            # What the move settled stays settled: a second settle of it moves nothing.
            await table.settle(conn, [Settled("batched", 4, table.assembled, late=True)])
        assert (await _rows(engine, table))["batched"] == (table.batched.value, 4, 4, 2, None)
        async with engine.connect() as conn:
            states, _, late = await table.tally(conn, table.parts)
        assert late == 2 and states["open"] == 1


async def test_a_settled_rollout_is_no_longer_finished_unless_a_finish_came_meanwhile(
    trace_server: dict[str, Any]
) -> None:
    """A finish makes its rollout due at once; once a trajectory holds it, the rollout
    waits for the quiet period again."""
    table, own = TABLES["gateway_rollouts"]
    finished = table.table.c.finished
    async with migrated(trace_server) as engine:
        await _arrive(engine, table, own, {"done": 1, "more": 1})
        await _arrive(engine, table, own, {"more": 1})
        async with engine.begin() as conn:
            await table.settle(conn, [Settled("done", 1, table.assembled),
                                      Settled("more", 1, table.assembled)])
            rows = dict((await conn.execute(sa.select(table.id, finished))).all())
        assert rows == {"done": False, "more": True}
