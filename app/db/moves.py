"""State machines in the database: the one way a row's state changes.

A table's state column (a trace's `stage`, a batch's `state`, a run's `status`, the
Atropos groups' and batches' `state`) moves only by `StateMachine.move(target)`: an
`UPDATE ... SET state = :target WHERE state IN (:sources)` whose sources are the
states the transition table lets move to `target`. Asking for a move the table does
not allow raises `ForbiddenMove` before anything is written; a row that is in another
state by the time the statement runs (someone moved it first) is left alone, and the
statement's rowcount says so.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from enum import StrEnum
from typing import Any, Generic, TypeVar

import sqlalchemy as sa

from app.db.models import BATCHES, TRACES
from app.db.types import utcnow
from app.domain import BATCH_TRANSITIONS, TRANSITIONS, BatchState, Stage

S = TypeVar("S", bound=StrEnum)

# A row no worker holds: its lease columns as a move (or a give-up) leaves them.
RELEASED = {"lease_owner": None, "lease_expires_at": None}


class ForbiddenMove(Exception):
    """A move its transition table does not allow: a mistake in the code, never in
    the data, so it is raised before the statement is built."""


class StateMachine(Generic[S]):
    """A state column and its transition table: `moves[s]` are the states a row in
    `s` may move to; `entries` those a new row may be inserted in."""

    def __init__(
        self,
        name: str,
        column: sa.Column[Any],
        moves: Mapping[S, Collection[S]],
        *,
        entries: Collection[S],
    ) -> None:
        self.name = name
        self.column = column
        self.moves = moves
        self.entries = frozenset(entries)

    def allows(self, source: S, target: S) -> bool:
        return target in self.moves[source]

    def sources(self, target: S, expected: Iterable[S] | None = None) -> list[S]:
        """The states a move to `target` starts from: `expected`, each of which must
        allow it, or by default every state that does."""
        if expected is None:
            sources = [s for s in self.moves if self.allows(s, target)]
        else:
            sources = list(expected)
            for source in sources:
                if not self.allows(source, target):
                    raise ForbiddenMove(f"{self.name} {source} -> {target} is not an allowed move")
        if not sources:
            raise ForbiddenMove(f"no {self.name} state may move to {target}")
        return sources

    def move(self, target: S, *, expected: Iterable[S] | None = None) -> sa.Update:
        """`UPDATE <table> SET <state> = target[, updated_at = now] WHERE <state> IN
        (sources)`, for the caller to narrow with `.where()` (the row, its lease) and
        extend with `.values()`. With one source the condition is `<state> = :source`,
        which executemany accepts (an IN list it does not)."""
        sources = [s.value for s in self.sources(target, expected)]
        column = self.column
        table = column.table
        values: dict[str, Any] = {column.name: target.value}
        if "updated_at" in table.c:
            values["updated_at"] = utcnow()
        where = column == sources[0] if len(sources) == 1 else column.in_(sources)
        return sa.update(table).where(where).values(values)

    def enter(self, state: S) -> str:
        """The value a new row is inserted with; ForbiddenMove unless it is an entry."""
        if state not in self.entries:
            raise ForbiddenMove(f"a new {self.name} starts {state}, which is not an entry state")
        return state.value


TRACE_STAGES: StateMachine[Stage] = StateMachine(
    "trace", TRACES.c.stage, TRANSITIONS, entries=TRANSITIONS[Stage.RECEIVED]
)
BATCH_STATES: StateMachine[BatchState] = StateMachine(
    "batch", BATCHES.c.state, BATCH_TRANSITIONS, entries={BatchState.PENDING}
)
