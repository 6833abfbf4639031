"""Storing traces: the trace kind of the group commit (app/db/group_commit.py).

A trace comes ready to insert (`PreparedTrace`, made in an ingest process): its values
in a form both drivers take as they are, inserted with SQL written once
(`dialect.BulkInsert`) with ON CONFLICT DO NOTHING; the trace_ids that already existed
are looked up in the same transaction, and a resend is answered with the stored result
(the same content) or a conflict (other content).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import orjson
import sqlalchemy as sa
from pydantic import Field
from sqlalchemy.ext.asyncio import AsyncEngine
from typing_extensions import TypedDict  # pydantic needs this one on 3.11

from app.db import search
from app.db.dialect import BulkInsert, OneHop
from app.db.errors import outage_of
from app.db.group_commit import GroupCommit
from app.db.models import PAYLOAD_COLUMNS, PAYLOADS, TRACES
from app.domain import Stage, Status
from app.errors import Conflict, HubError
from app.evaluation.filters import RejectReason
from app.evaluation.scoring import RuleResult
from app.outage import Outage

# What a resent trace is answered with: the stored result.
RESULT_COLUMNS = (
    TRACES.c.trace_id,
    TRACES.c.content_hash,
    TRACES.c.stage,
    TRACES.c.status,
    TRACES.c.total_tokens,
    TRACES.c.reward,
    TRACES.c.env_reward,
    TRACES.c.reward_breakdown,
    TRACES.c.reject_reasons,
)


class IngestResult(TypedDict):
    """One trace as stored (or as found, when the same content was resent): the answer
    of POST /v1/traces, and its schema in the OpenAPI document."""

    trace_id: Annotated[str, Field(
        description="The trace's id: the one sent, or one the hub assigned")]
    stage: Annotated[Stage, Field(description="Where the trace is in the pipeline")]
    status: Annotated[Status, Field(description="The task's outcome as the agent reported it")]
    total_tokens: Annotated[int, Field(description="Tokens of the canonical trace (cl100k_base)")]
    reward: Annotated[float | None, Field(
        description="The sum of the reward rules' points and the weighted env_reward")]
    env_reward: Annotated[float | None, Field(
        description="The environment's own reward as the agent sent it; null when none")]
    reward_breakdown: Annotated[dict[str, RuleResult] | None, Field(
        description="Each reward rule's result, by name")]
    reject_reasons: Annotated[list[RejectReason], Field(
        description="Why it was rejected: one entry per filter it failed; empty when accepted")]
    duplicate: Annotated[bool, Field(
        description="True when this trace_id was already stored with the same content")]


@dataclass(frozen=True, slots=True)
class Stored:
    """The answer for one trace: the row as committed (or as found, if resent)."""

    trace_id: str
    stage: Stage
    status: Status
    total_tokens: int
    reward: float | None
    env_reward: float | None
    reward_breakdown: dict[str, RuleResult] | None
    reject_reasons: list[RejectReason] | None
    duplicate: bool = False

    def __reduce__(self) -> tuple[Any, ...]:
        # Rows travel back from the ingest processes pickled; a slots dataclass's own
        # pickling walks dataclasses.fields() on every load.
        return (Stored, tuple(getattr(self, name) for name in self.__slots__))

    def to_json(self) -> IngestResult:
        return {
            "trace_id": self.trace_id,
            "stage": self.stage,
            "status": self.status,
            "total_tokens": self.total_tokens,
            "reward": self.reward,
            "env_reward": self.env_reward,
            "reward_breakdown": self.reward_breakdown,
            "reject_reasons": self.reject_reasons or [],
            "duplicate": self.duplicate,
        }


# The columns a new trace is written with (the others keep their defaults).
INSERT = BulkInsert(
    TRACES,
    "trace_id",
    (
        "trace_id", "created_at", "updated_at", "status", "stage", "total_tokens",
        "compressed_tokens", "reward", "env_reward", "reward_breakdown", "reject_reasons",
        "scored_with", "source_format", "env", "model", "agent_name", "policy_version",
        "group_id", "content_hash", "attempts", "compression",
    ),
)
# Its payloads, in their own table (`compressed`: when its ingest process compressed
# it). A row left behind by a trace deleted with foreign keys off (the sqlite3 shell's
# default) is replaced.
PAYLOADS_INSERT = BulkInsert(PAYLOADS, "trace_id", ("trace_id", *PAYLOAD_COLUMNS),
                             replace=True)


_AT = {name: INSERT.columns.index(name) for name in INSERT.columns}
_PAYLOAD_AT = {name: PAYLOADS_INSERT.columns.index(name) - 1
               for name in PAYLOADS_INSERT.columns[1:]}
_JSON_ANSWERS = ("reward_breakdown", "reject_reasons")


@dataclass(frozen=True, slots=True)
class PreparedTrace:
    """One trace, ready to insert: its `values` (INSERT.columns, in the form
    BulkInsert takes), its `payloads` (PAYLOADS_INSERT.columns after the trace_id), its
    search text, and what compression did at entry, for the metrics: the kind of skip
    (SKIP_KINDS), or (strategy, tokens before, tokens after) of the compression made
    (None, None: it entered before compression); its answer is read from its values."""

    values: tuple[Any, ...]
    payloads: tuple[Any, ...]
    search_text: search.SearchText
    skip_kind: str | None = None
    compressed_by: tuple[str, int, int] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # Rows travel back from the ingest processes pickled; a slots dataclass's own
        # pickling walks dataclasses.fields() on every load.
        return (PreparedTrace, (self.values, self.payloads, self.search_text, self.skip_kind,
                                self.compressed_by))

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> PreparedTrace:
        """From the row as column -> value (payloads included), its search_text,
        skip_kind and compressed_by (`Preparer.row`)."""
        return cls(INSERT.values(row), PAYLOADS_INSERT.values(row)[1:], row["search_text"],
                   row.get("skip_kind"), row.get("compressed_by"))

    def __getitem__(self, column: str) -> Any:
        """A column's value as inserted (JSON as its text), payloads included."""
        at = _AT.get(column)
        return self.payloads[_PAYLOAD_AT[column]] if at is None else self.values[at]

    @property
    def trace_id(self) -> str:
        trace_id: str = self["trace_id"]
        return trace_id

    @property
    def content_hash(self) -> str:
        content_hash: str = self["content_hash"]
        return content_hash

    @property
    def stage(self) -> str:
        stage: str = self["stage"]
        return stage

    @property
    def reject_reasons(self) -> list[dict[str, Any]] | None:
        reasons = self["reject_reasons"]
        return None if reasons is None else orjson.loads(reasons)  # inserted as its text

    @property
    def source_format(self) -> str:
        source: str = self["source_format"]
        return source

    def row(self) -> dict[str, Any]:
        """Column -> value in the form SQLAlchemy's types take (JSON as EncodedJSON),
        the payloads' columns included."""
        return INSERT.row(self.values) | PAYLOADS_INSERT.row((self.trace_id, *self.payloads))

    @property
    def stored(self) -> Stored:
        """The answer once it is stored."""
        row = {column.name: self[column.name] for column in RESULT_COLUMNS}
        for name in _JSON_ANSWERS:  # inserted as their JSON text
            if row[name] is not None:
                row[name] = orjson.loads(row[name])
        return _stored(row, duplicate=False)


class _TraceKind:
    """Traces, for the group commit: the first of each trace_id in a batch is inserted;
    the others, and those stored before, are answered as resends."""

    name = "traces"

    def write(
        self, conn: sa.Connection, items: Sequence[PreparedTrace]
    ) -> list[Stored | HubError]:
        first: dict[str, int] = {}  # trace_id -> the place of its first in the batch
        for n, trace in enumerate(items):
            first.setdefault(trace.trace_id, n)
        new_ids = insert_traces(conn, [items[n] for n in first.values()])
        known = _lookup(conn, [tid for tid in first if tid not in new_ids])
        results: list[Stored | HubError] = []
        for n, trace in enumerate(items):
            tid = trace.trace_id
            if tid in new_ids and first[tid] == n:
                results.append(trace.stored)
                continue
            if tid in known:
                existing, content_hash = known[tid]
            else:  # the first of its batch
                existing, content_hash = items[first[tid]].stored, items[first[tid]].content_hash
            if content_hash == trace.content_hash:
                results.append(_duplicate(existing))
            else:
                results.append(Conflict(
                    f"trace_id {tid!r} is already stored with other content; "
                    "send it under a new trace_id",
                    field="trace_id",
                ))
        return results


class TraceInserter:
    """The group commit of traces: `insert` returns once the trace is committed."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        writer: OneHop | None = None,
        outage: Outage | None = None,
        max_batch: int = 256,
        max_queue: int = 10_000,
        max_wait: float | None = None,
        retry_after: int = 2,
        on_commit: Callable[[list[PreparedTrace]], None] | None = None,
    ) -> None:
        """`writer`: the hub's one (without it, one of its own). `max_wait`: the
        longest a trace waits for its commit before it is withdrawn and its request
        answered 503 with `retry_after` (None: no bound, as for `atropos import`, whose
        callers wait for each chunk)."""
        self._own_writer = writer is None
        self._writer = writer or OneHop(engine)
        self.commits: GroupCommit[PreparedTrace, Stored] = GroupCommit(
            _TraceKind(), self._writer, outage or outage_of(engine),
            max_items=max_batch, max_queue=max_queue, max_wait=max_wait,
            retry_after=retry_after, on_commit=on_commit,
        )

    def write_wait(self) -> float:
        return self.commits.write_wait()

    async def insert(self, trace: PreparedTrace) -> Stored:
        """Store one trace; returns once it is committed (or found already stored).
        Raises Conflict for a known trace_id with other content."""
        return await self.submit(trace)

    def submit(self, trace: PreparedTrace) -> asyncio.Future[Stored]:
        """Queue a trace now (traces are written in the order submitted) and return the
        future that resolves once it is committed."""
        return self.commits.submit(trace)

    def start(self) -> None:
        self.commits.start()

    async def stop(self) -> None:
        """Finish what is queued, then stop."""
        await self.commits.stop()
        if self._own_writer:
            await self._writer.close()


def insert_traces(conn: sa.Connection, rows: Sequence[PreparedTrace]) -> set[str]:
    """Insert the rows (distinct trace_ids) not stored yet, each with its payloads and
    search text; returns the trace_ids that were new."""
    new_ids: set[str] = INSERT.run(conn, [row.values for row in rows])
    new = [row for row in rows if row.trace_id in new_ids]
    PAYLOADS_INSERT.run(conn, [(row.trace_id, *row.payloads) for row in new])
    search.index(conn, [(row.trace_id, row.search_text) for row in new])
    return new_ids


def _lookup(conn: sa.Connection, trace_ids: list[str]) -> dict[str, tuple[Stored, str]]:
    """The stored answer and content hash of each of `trace_ids` that is stored."""
    if not trace_ids:
        return {}
    result = conn.execute(sa.select(*RESULT_COLUMNS).where(TRACES.c.trace_id.in_(trace_ids)))
    return {
        row.trace_id: (_stored(row._mapping, duplicate=True), row.content_hash)
        for row in result
    }


def _duplicate(stored: Stored) -> Stored:
    return stored if stored.duplicate else dataclasses.replace(stored, duplicate=True)


def _stored(row: Mapping[Any, Any], *, duplicate: bool) -> Stored:
    return Stored(
        trace_id=row["trace_id"],
        stage=Stage(row["stage"]),
        status=Status(row["status"]),
        total_tokens=row["total_tokens"],
        reward=row["reward"],
        env_reward=row["env_reward"],
        reward_breakdown=row["reward_breakdown"],
        reject_reasons=row["reject_reasons"],
        duplicate=duplicate,
    )
