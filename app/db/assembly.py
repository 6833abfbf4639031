"""Tables of things assembled from parts that keep arriving: an OTLP trace from its
spans (otlp_traces), a gateway rollout from its calls and finish (gateway_rollouts).

A row counts the parts received (`parts`), those the last assembly dealt with (`seen`)
and those that came once its trajectory was batched (`late`). A new part opens the row
again: an upsert, the one write of its state that is not a move (it has no WHERE on
the state). The assembly stage takes the open rows come due and settles what it made
of the parts it read; a row that received parts meanwhile stays open, and due.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Generic, TypeVar

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from app.db.dialect import Dialect, insert
from app.db.moves import StateMachine
from app.domain import Stage

S = TypeVar("S", bound=StrEnum)

# A trajectory in these stages went to training: an assembly does not replace it any more.
FINAL_STAGES = (Stage.BATCHED.value, Stage.DELIVERED.value)


@dataclass(frozen=True, slots=True)
class Due:
    """A row come due (`id`), and how many parts it had then."""

    id: str
    parts: int


@dataclass(frozen=True, slots=True)
class Settled(Generic[S]):
    """What the assembly made of a row's first `seen` parts."""

    id: str
    seen: int
    state: S
    late: bool = False  # the parts since the last assembly came after it was batched
    error: str | None = None


class AssemblyTable(Generic[S]):
    """One table of assemblies: its state machine (the table is the state column's),
    the names of its columns, and the states an assembly settles in: `assembled`,
    `refused`, and `batched` for a row whose trajectory was batched already. `settled`:
    more values a move out of open sets (the row's own flags, done with)."""

    def __init__(
        self,
        states: StateMachine[S],
        *,
        id: str,
        parts: str,
        seen: str,
        late: str,
        first: str,
        last: str,
        open: S,
        assembled: S,
        refused: S,
        batched: S,
        settled: Mapping[str, Any] | None = None,
    ) -> None:
        self.states = states
        self.table = states.column.table
        c = self.table.c
        self.id, self.parts, self.seen, self.late = c[id], c[parts], c[seen], c[late]
        self.first, self.last = c[first], c[last]
        self.open, self.assembled, self.refused = open, assembled, refused
        self.batched = batched
        self._settled = dict(settled or {})

    def opened(self, id: str, parts: int, at: datetime) -> dict[str, Any]:
        """A new row's values, for `reopen`: open with `parts`, none seen yet."""
        return {self.id.key: id, self.states.column.key: self.states.enter(self.open),
                self.parts.key: parts, self.seen.key: 0, self.late.key: 0,
                self.first.key: at, self.last.key: at, "error": None}

    def reopen(
        self, dialect: Dialect, also: Callable[[Any], Mapping[str, Any]] = lambda _: {}
    ) -> Any:
        """Insert rows (`opened`), or open those stored again with their new parts
        added; `also(excluded)`: more columns set then, from the row sent."""
        upsert = insert(dialect, self.table)
        excluded = upsert.excluded
        set_ = {
            self.states.column.key: self.open.value,
            self.parts.key: self.parts + excluded[self.parts.key],
            self.last.key: excluded[self.last.key],
            "error": None,
            **also(excluded),
        }
        return upsert.on_conflict_do_update(index_elements=[self.id.key], set_=set_)

    async def due(
        self, conn: AsyncConnection, ready: sa.ColumnElement[bool], limit: int,
        exclude: Sequence[str] = (),
    ) -> list[Due]:
        """Open rows that are `ready`, but those in `exclude` (in preparation already);
        the oldest first."""
        where = [self.states.column == self.open.value, ready]
        if exclude:
            where.append(self.id.not_in(exclude))
        rows = await conn.execute(
            sa.select(self.id, self.parts).where(*where).order_by(self.first).limit(limit)
        )
        return [Due(id_, parts) for id_, parts in rows]

    def settled(self, due: Sequence[Due], outcomes: Mapping[str, tuple[str, str | None]]
                ) -> list[Settled[S]]:
        """What to settle for each row come due, given what became of its trajectory
        (app/stages/assembly.py `outcome`); none for one whose trajectory moved
        meanwhile ("again"): it stays open, and due, for the next round."""
        states = {"late": self.batched, "refused": self.refused}
        out: list[Settled[S]] = []
        for d in due:
            what, error = outcomes[d.id]
            if what != "again":
                out.append(Settled(d.id, d.parts, states.get(what, self.assembled),
                                   late=what == "late", error=error))
        return out

    async def settle(self, conn: AsyncConnection, settled: Sequence[Settled[S]]) -> None:
        """Record each row's outcome, in a statement per state reached. One that
        received parts meanwhile stays open (and due), with what was done counted;
        late parts are counted."""
        if not settled:
            return
        seen = sa.bindparam("b_seen", type_=sa.Integer)
        done = {
            self.seen.key: seen,
            "error": sa.bindparam("b_error", type_=sa.Text),
            self.late.key: self.late + sa.case(
                (sa.bindparam("b_late", type_=sa.Boolean), seen - self.seen), else_=0
            ),
        }
        this = self.id == sa.bindparam("b_id", type_=sa.String)
        params = {s.id: {"b_id": s.id, "b_seen": s.seen, "b_error": s.error, "b_late": s.late}
                  for s in settled}
        for state in dict.fromkeys(s.state for s in settled):
            move = self.states.move(state, expected=[self.open])
            moved = move.where(this, self.parts == seen).values(done).values(self._settled)
            await conn.execute(moved, [params[s.id] for s in settled if s.state is state])
        await conn.execute(
            sa.update(self.table).where(this, self.parts != seen).values(done),
            list(params.values()),
        )

    async def tally(
        self, conn: AsyncConnection, summed: sa.Column[Any], shown: Mapping[S, S] | None = None
    ) -> tuple[Counter[str], int, int]:
        """For /v1/stats: rows by state (those in a key of `shown` counted as its
        value), the sum of `summed` and late parts over all of them."""
        by = {k.value: v.value for k, v in (shown or {}).items()}
        state = self.states.column
        rows = await conn.execute(
            sa.select(state, sa.func.count(), sa.func.sum(summed), sa.func.sum(self.late))
            .group_by(state)
        )
        states: Counter[str] = Counter()
        total = late = 0
        for value, n, of_summed, of_late in rows:
            states[by.get(value, value)] += n
            total += int(of_summed or 0)
            late += int(of_late or 0)
        return states, total, late
