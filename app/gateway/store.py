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

from app.db.dialect import Dialect, dialect_of, insert, insert_ignoring_conflicts
from app.db.models import GATEWAY_CALLS, GATEWAY_ROLLOUTS
from app.db.moves import StateMachine
from app.domain import Stage


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
# A trajectory in these stages went to training: it is not replaced any more.
FINAL_STAGES = (Stage.BATCHED.value, Stage.DELIVERED.value)


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
        [{"rollout_id": row["rollout_id"], "state": ROLLOUT_STATES.enter(RolloutState.OPEN),
          "calls": row["calls"], "changes": row["changes"], "seen_changes": 0,
          "late_changes": 0, "finished": finish is not None, "finish": finish,
          "first_call_at": row["at"], "last_change_at": row["at"], "error": None}
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
    return _Statements(once.returning(GATEWAY_CALLS.c.rollout_id),
                       _open(dialect, finish=False), _open(dialect, finish=True))


def _open(dialect: Dialect, *, finish: bool) -> Any:
    r = GATEWAY_ROLLOUTS.c
    upsert = insert(dialect, GATEWAY_ROLLOUTS)
    excluded = upsert.excluded
    set_: dict[str, Any] = {
        "state": RolloutState.OPEN.value,
        "calls": r.calls + excluded.calls,
        "changes": r.changes + excluded.changes,
        "last_change_at": excluded.last_change_at,
        "error": None,
    }
    if finish:
        set_.update(finished=True, finish=excluded.finish)
    return upsert.on_conflict_do_update(index_elements=["rollout_id"], set_=set_)


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


@dataclass(frozen=True, slots=True)
class Due:
    rollout_id: str
    changes: int


async def due(conn: AsyncConnection, now: datetime, quiet: float, limit: int) -> list[Due]:
    """Open rollouts that were finished, or have had no call for `quiet` seconds;
    oldest first."""
    r = GATEWAY_ROLLOUTS.c
    rows = await conn.execute(
        sa.select(r.rollout_id, r.changes)
        .where(r.state == RolloutState.OPEN.value,
               sa.or_(r.finished, r.last_change_at <= now - timedelta(seconds=quiet)))
        .order_by(r.first_call_at)
        .limit(limit)
    )
    return [Due(row.rollout_id, row.changes) for row in rows]


@dataclass(slots=True)
class Rollout:
    """A rollout's captured calls, in the order they started, and its finish."""

    rollout_id: str
    calls: list[dict[str, Any]]
    finish: dict[str, Any] | None


async def rollouts(conn: AsyncConnection, rollout_ids: list[str]) -> dict[str, Rollout]:
    c, r = GATEWAY_CALLS.c, GATEWAY_ROLLOUTS.c
    out = {rollout_id: Rollout(rollout_id, [], None) for rollout_id in rollout_ids}
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


@dataclass(frozen=True, slots=True)
class Settled:
    """What the assembly made of a rollout's first `seen` changes."""

    rollout_id: str
    seen: int
    state: RolloutState
    late: bool = False  # the changes since the last assembly came after it was batched
    error: str | None = None


async def settle(conn: AsyncConnection, settled: list[Settled]) -> None:
    """Record each rollout's outcome. One that changed meanwhile stays open (and due),
    with what was done counted; late changes are counted."""
    r = GATEWAY_ROLLOUTS.c
    for s in settled:
        done = {
            "seen_changes": s.seen,
            "error": s.error,
            "finished": False,
            "late_changes": r.late_changes + (s.seen - r.seen_changes if s.late else 0),
        }
        this = r.rollout_id == s.rollout_id
        moved = await conn.execute(
            ROLLOUT_STATES.move(s.state, expected=[RolloutState.OPEN])
            .where(this, r.changes == s.seen).values(done)
        )
        if moved.rowcount == 0:
            await conn.execute(sa.update(GATEWAY_ROLLOUTS).where(this).values(
                {k: v for k, v in done.items() if k != "finished"}))


async def counts(conn: AsyncConnection) -> dict[str, int]:
    """For /v1/stats: rollouts by assembly state, calls captured, changes that came late."""
    r = GATEWAY_ROLLOUTS.c
    rows = await conn.execute(
        sa.select(r.state, sa.func.count(), sa.func.sum(r.calls), sa.func.sum(r.late_changes))
        .group_by(r.state)
    )
    out = {f"{state.value}_rollouts": 0 for state in RolloutState}
    out.update(calls=0, late_changes=0)
    for state, n, calls, late in rows:
        out[f"{state}_rollouts"] = n
        out["calls"] += int(calls or 0)
        out["late_changes"] += int(late or 0)
    return out
