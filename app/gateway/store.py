"""The statements on gateway_calls and gateway_rollouts (app/db/models.py says what
each row means): calls stored once each, rollouts finished or gone quiet coming due,
and what the assembly made of them."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from app.db.assembly import AssemblyTable, Due
from app.db.dialect import Dialect, dialect_of, insert_ignoring_conflicts
from app.db.models import GATEWAY_CALLS, GATEWAY_ROLLOUTS
from app.db.moves import StateMachine


class RolloutState(StrEnum):
    """Where a rollout's assembly is (the gateway_rollouts.state column).

    open -> assembled | refused. A call or a finish makes either open again; one that
    comes once the trajectory was batched is counted late (the trajectory stays)."""

    OPEN = "open"  # it has calls (or a finish) its trajectory does not hold yet
    ASSEMBLED = "assembled"  # its trajectory holds every call
    REFUSED = "refused"  # its calls make no trajectory; `error` says why


TRANSITIONS: dict[RolloutState, frozenset[RolloutState]] = {
    RolloutState.OPEN: frozenset({RolloutState.ASSEMBLED, RolloutState.REFUSED}),
    RolloutState.ASSEMBLED: frozenset({RolloutState.OPEN}),
    RolloutState.REFUSED: frozenset({RolloutState.OPEN}),
}
ROLLOUT_STATES: StateMachine[RolloutState] = StateMachine(
    "gateway rollout", GATEWAY_ROLLOUTS.c.state, TRANSITIONS, entries={RolloutState.OPEN}
)
# The rollouts' assembly (app/db/assembly.py): a rollout is assembled from its changes,
# its calls and finishes. One whose trajectory was batched stays assembled, and a
# finish is done with once a trajectory holds it.
ROLLOUT_ASSEMBLY: AssemblyTable[RolloutState] = AssemblyTable(
    ROLLOUT_STATES, id="rollout_id", parts="changes", seen="seen_changes",
    late="late_changes", first="first_call_at", last="last_change_at", open=RolloutState.OPEN,
    assembled=RolloutState.ASSEMBLED, refused=RolloutState.REFUSED,
    batched=RolloutState.ASSEMBLED, settled={"finished": False},
)


@dataclass(frozen=True, slots=True)
class Captured:
    """One call, ready to store."""

    rollout_id: str
    call_id: str
    started_at: datetime
    continues: str | None  # stitching: app/formats/stitching.py
    call: dict[str, Any]


def write(conn: sa.Connection, calls: Sequence[Captured]) -> None:
    """Store the calls (a call resent by a retry of this write is stored once) and open
    their rollouts. A synchronous connection: the writer runs it in one hop."""
    if not calls:
        return
    new = conn.execute(
        _statements(dialect_of(conn)).insert_calls,
        [{"rollout_id": c.rollout_id, "call_id": c.call_id, "started_at": c.started_at,
          "continues": c.continues, "call": c.call} for c in calls],
    ).scalars().all()
    per_rollout: dict[str, int] = {}
    for rollout_id in new:
        per_rollout[rollout_id] = per_rollout.get(rollout_id, 0) + 1
    first: dict[str, datetime] = {}
    for c in calls:
        first.setdefault(c.rollout_id, c.started_at)
    _touch(conn, [{"rollout_id": r, "calls": n, "changes": n, "at": first[r]}
                  for r, n in per_rollout.items()])


def _touch(conn: sa.Connection, rows: list[dict[str, Any]], *,
           finish: dict[str, Any] | None = None) -> None:
    """Open each rollout (inserted, or reopened) with its new calls and changes."""
    if not rows:
        return
    statements = _statements(dialect_of(conn))
    conn.execute(
        statements.open_rollouts if finish is None else statements.finish_rollouts,
        [{**ROLLOUT_ASSEMBLY.opened(row["rollout_id"], row["changes"], row["at"]),
          "calls": row["calls"], "finished": finish is not None, "finish": finish}
         for row in rows],
    )


@dataclass(frozen=True, slots=True)
class _Statements:
    insert_calls: Any
    open_rollouts: Any
    finish_rollouts: Any


@functools.cache
def _statements(dialect: Dialect) -> _Statements:
    """Built once per dialect: every captured call runs them."""
    once = insert_ignoring_conflicts(dialect, GATEWAY_CALLS, "rollout_id", "call_id")
    r = GATEWAY_ROLLOUTS.c
    return _Statements(
        once.returning(GATEWAY_CALLS.c.rollout_id),
        ROLLOUT_ASSEMBLY.reopen(dialect, lambda excluded: {"calls": r.calls + excluded.calls}),
        ROLLOUT_ASSEMBLY.reopen(dialect, lambda excluded: {
            "calls": r.calls + excluded.calls, "finished": True, "finish": excluded.finish}),
    )


async def finish(conn: AsyncConnection, rollout_id: str, body: dict[str, Any],
                 now: datetime) -> int | None:
    """Record the rollout's finish (the last one wins) and make it due now; returns its
    calls, or None when the hub has captured no call of it."""
    r = GATEWAY_ROLLOUTS.c
    calls = await conn.scalar(sa.select(r.calls).where(r.rollout_id == rollout_id))
    if calls is None:
        return None
    await conn.run_sync(lambda sync: _touch(
        sync, [{"rollout_id": rollout_id, "calls": 0, "changes": 1, "at": now}], finish=body
    ))
    return int(calls)


async def rollout_of(conn: AsyncConnection, digests: Sequence[str]) -> str | None:
    """The rollout whose latest call a call with these prefix digests continues (the
    longest prefix first), if any."""
    if not digests:
        return None
    c = GATEWAY_CALLS.c
    rows = (await conn.execute(
        sa.select(c.continues, c.rollout_id).where(c.continues.in_(list(digests)))
    )).all()
    found = {row.continues: row.rollout_id for row in rows}
    return next((found[d] for d in digests if d in found), None)


async def due(conn: AsyncConnection, now: datetime, quiet: float, limit: int) -> list[Due]:
    """Open rollouts that were finished, or have had no call for `quiet` seconds;
    oldest first."""
    r = GATEWAY_ROLLOUTS.c
    return await ROLLOUT_ASSEMBLY.due(
        conn, sa.or_(r.finished, r.last_change_at <= now - timedelta(seconds=quiet)), limit)


@dataclass(slots=True)
class CapturedRollout:
    """A rollout's captured calls, in the order they started, and its finish."""

    rollout_id: str
    calls: list[dict[str, Any]]
    finish: dict[str, Any] | None


async def rollouts(conn: AsyncConnection, rollout_ids: list[str]) -> dict[str, CapturedRollout]:
    c, r = GATEWAY_CALLS.c, GATEWAY_ROLLOUTS.c
    out = {rollout_id: CapturedRollout(rollout_id, [], None) for rollout_id in rollout_ids}
    for row in await conn.execute(
        sa.select(r.rollout_id, r.finish).where(r.rollout_id.in_(rollout_ids))
    ):
        out[row.rollout_id].finish = row.finish
    for row in await conn.execute(
        sa.select(c.rollout_id, c.call).where(c.rollout_id.in_(rollout_ids))
        .order_by(c.rollout_id, c.started_at, c.call_id)
    ):
        out[row.rollout_id].calls.append(row.call)
    return out


async def counts(conn: AsyncConnection) -> dict[str, int]:
    """For /v1/stats: rollouts by assembly state, calls captured, changes that came late."""
    states, calls, late = await ROLLOUT_ASSEMBLY.tally(conn, GATEWAY_ROLLOUTS.c.calls)
    out = {f"{state.value}_rollouts": states[state.value] for state in RolloutState}
    out.update(calls=calls, late_changes=late)
    return out
