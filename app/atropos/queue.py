"""Putting scored groups in the queue: group commit, per-env buffering, the bound.

Requests hand their groups to `GroupWriter.submit` and wait. A transaction takes
what has accumulated, stores it, and each request is answered only after the commit:
an answered group is on disk. The in-memory queue holds only requests not yet
answered, and is itself bounded.

A group whose size is not its env's group_size goes to that env's buffer; as soon
as some buffered groups add up to group_size they enter the queue together, as
atroposlib does (`packing.groups_summing_to`). The queue bound counts every group
not yet served (buffered, queued or in a formed batch).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
import sqlalchemy as sa

from app.atropos.models import (
    ANY_JSON_FIELDS,
    InvalidGroups,
    ScoredData,
    parse_group,
    parse_groups,
)
from app.atropos.packing import groups_summing_to
from app.atropos.presence import Presence, record
from app.atropos.segments import Segment, deflate
from app.atropos.tables import (
    ENV_GROUPS,
    ENVS,
    GROUP_STATES,
    GROUPS,
    SEGMENTS,
    STATE,
    WAITING,
    AtroposDb,
    AtroposGroupState,
)
from app.config import AtroposConfig
from app.db.dialect import Dialect, for_update, reserve_ids
from app.db.group_commit import GroupCommit
from app.db.types import utcnow
from app.errors import HubError, Invalid, PayloadTooLarge, Unavailable
from app.evaluation.redaction import Redactor, redactor_for
from app.ingest.body import json_array
from app.metrics import GROUPS_RECEIVED, Labeled
from app.outage import Outage

log = logging.getLogger("atropos.queue")

# One transaction takes at most this much JSON, so that a burst of large groups is
# committed in several steps rather than held in memory as one.
_MAX_COMMIT_BYTES = 16 * 1024 * 1024
# Requests waiting for the writer; more are answered 503 at once.
_MAX_PENDING = 512


@dataclass(frozen=True, slots=True)
class NewGroup:
    """A validated group, ready to store: its JSON, deflated, is what /batch serves."""

    env_id: int | None
    size: int
    json: Segment
    fill_logprobs: bool

    @property
    def nbytes(self) -> int:
        return self.json.size

    @classmethod
    def from_scored(cls, data: ScoredData, redactor: Redactor) -> NewGroup:
        """`redactor` rewrites the secrets in its strings (messages, overrides); the
        token ids are stored as sent (docs/privacy.md)."""
        try:
            # The fields hold plain lists and dicts (no nested models), in declaration
            # order: __dict__ is model_dump() without the copy.
            raw = orjson.dumps(data.__dict__)
        except (orjson.JSONEncodeError, TypeError) as exc:
            # An integer past 64 bits, an unpaired surrogate, nesting past 254 levels:
            # bad input, not a server fault.
            raise Invalid(f"the group cannot be stored as JSON: {exc}") from None
        # Secrets are looked for where there are strings: not in the token ids and the
        # other numbers, most of the group's bytes.
        texts = {name: data.__dict__[name] for name in ANY_JSON_FIELDS}
        redacted, redactions = redactor.redact(texts)
        if redactions:
            raw = orjson.dumps({**data.__dict__, **redacted})
        return cls(
            env_id=data.env_id,
            size=len(data.tokens),
            json=deflate(raw),
            fill_logprobs=data.inference_logprobs is None,
        )


def prepare(body: bytes, many: bool, max_groups: int, privacy: str) -> list[NewGroup]:
    """The groups of a /scored_data body (one group) or a /scored_data_list body (a
    list of at most `max_groups`, counted before any is parsed), validated, redacted as
    the privacy section (its JSON) says, and deflated; Invalid (422) for what atroposlib
    would refuse. Pure CPU work: run in an ingest process (app/ingest/processes.py)."""
    try:
        if many:
            too_many = PayloadTooLarge(
                f"more than {max_groups} groups in one list; atropos.max_groups_per_request "
                f"is {max_groups}: send them in several requests",
                field="atropos.max_groups_per_request",
            )
            groups = parse_groups(json_array(body, max_groups, too_many))
        else:
            groups = [parse_group(body)]
    except InvalidGroups as exc:
        raise Invalid.from_pydantic(exc.errors) from None
    redactor = redactor_for(privacy)
    return [NewGroup.from_scored(group, redactor) for group in groups]


@dataclass(frozen=True, slots=True)
class Placed:
    """Where a group went: the queue, or its env's buffer (with what the buffer
    holds afterwards, in sequences)."""

    buffered: bool = False
    buffer_size: int = 0


@dataclass(frozen=True, slots=True)
class _Request:
    groups: list[NewGroup]
    nbytes: int


class GroupWriter:
    """The group commit of Atropos groups (app/db/group_commit.py): each transaction
    admits what fits the queue's bound and places it (queue or buffer)."""

    name = "Atropos groups"

    def __init__(
        self,
        db: AtroposDb,
        config: AtroposConfig,
        presence: Presence,
        outage: Outage,
        *,
        max_wait: float | None = None,
    ) -> None:
        """`max_wait`: a submission's deadline (limits.max_write_wait_seconds): past it,
        503 and never stored."""
        self._db = db
        self._config = config
        self._presence = presence
        self._commits: GroupCommit[_Request, list[Placed]] = GroupCommit(
            self, db.writer, outage,
            max_items=_MAX_PENDING, max_weight=_MAX_COMMIT_BYTES,
            weight=lambda request: request.nbytes, max_queue=_MAX_PENDING,
            max_wait=max_wait, retry_after=config.retry_after_seconds,
        )

    @property
    def commits(self) -> GroupCommit[_Request, list[Placed]]:
        return self._commits

    async def submit(self, groups: list[NewGroup]) -> list[Placed]:
        """Store the groups (all or none); returns once they are committed."""
        nbytes = sum(g.nbytes for g in groups)
        self._check_fits_empty(len(groups), nbytes)
        placed = await self._commits.submit(_Request(groups, nbytes))
        for group in placed:
            _received("buffered" if group.buffered else "queued").inc()
        return placed

    def start(self) -> None:
        self._commits.start()

    async def stop(self) -> None:
        """Store what was submitted, then stop."""
        await self._commits.stop()

    def write(
        self, conn: sa.Connection, taken: Sequence[_Request]
    ) -> list[list[Placed] | HubError]:
        """One transaction (run off the event loop): admit what fits, place it."""
        results: list[list[Placed] | HubError] = []
        groups, nbytes = _waiting(conn)
        # A refused group was still sent by a living env.
        senders = self._presence.due(g.env_id for request in taken for g in request.groups)
        record(conn, senders, utcnow())
        placer: _Placer | None = None
        for request in taken:
            if not self._fits(groups + len(request.groups), nbytes + request.nbytes):
                results.append(self._full(groups, nbytes))
                continue
            groups += len(request.groups)
            nbytes += request.nbytes
            if placer is None:
                placer = _Placer(conn, self._db.dialect, _group_sizes(conn))
            results.append([placer.place(g) for g in request.groups])
        if placer is not None:
            placer.flush()
            _to_trajectories(conn, placer.stored)
        return results

    def _check_fits_empty(self, groups: int, nbytes: int) -> None:
        """A submission that would not fit even an empty queue: retrying cannot help."""
        config = self._config
        if config.queue_max_bytes is not None and nbytes > config.queue_max_bytes:
            raise PayloadTooLarge(
                f"{groups} group(s) of {nbytes} bytes could never be queued: "
                f"atropos.queue_max_bytes is {config.queue_max_bytes}",
                field="atropos.queue_max_bytes",
            )
        if groups > config.queue_max_groups:
            raise PayloadTooLarge(
                f"{groups} groups could never be queued: atropos.queue_max_groups is "
                f"{config.queue_max_groups}; send them in several requests",
                field="atropos.queue_max_groups",
            )

    def _fits(self, groups: int, nbytes: int) -> bool:
        return fits(self._config, groups, nbytes)

    def _full(self, groups: int, nbytes: int) -> Unavailable:
        limits = f"atropos.queue_max_groups is {self._config.queue_max_groups}"
        if self._config.queue_max_bytes is not None:
            limits += f", atropos.queue_max_bytes is {self._config.queue_max_bytes}"
        return self._overloaded(
            f"the Atropos queue is full ({groups} groups, {nbytes} bytes waiting; {limits}); "
            "retry once the trainer has taken batches"
        )

    def _overloaded(self, message: str) -> Unavailable:
        return Unavailable(message, retry_after=self._config.retry_after_seconds, code="queue_full")


_received = Labeled(GROUPS_RECEIVED)


class _Placer:
    """Places groups in order within one transaction: queue rows are inserted in
    runs, so that ids (the queue order) follow the order groups arrived in."""

    def __init__(self, conn: sa.Connection, dialect: Dialect, group_sizes: dict[int, int]):
        self._conn = conn
        self._dialect = dialect
        self._group_sizes = group_sizes
        self._queued: list[NewGroup] = []
        self._locked: set[int] = set()
        self._now = utcnow()
        # (segment id, env id) of every group stored: each becomes trajectories.
        self.stored: list[tuple[int, int | None]] = []

    def place(self, group: NewGroup) -> Placed:
        expected = self._group_sizes.get(group.env_id) if group.env_id is not None else None
        if expected is None or group.size == expected:
            self._queued.append(group)
            return Placed()
        self.flush()
        assert group.env_id is not None
        return self._buffer(group, group.env_id, expected)

    def flush(self) -> None:
        if self._queued:
            self._insert(self._queued, AtroposGroupState.QUEUED)
            self._queued = []

    def _insert(self, groups: list[NewGroup], state: AtroposGroupState) -> None:
        segment_ids = reserve_ids(self._conn, SEGMENTS, len(groups))
        segments = [
            {"id": sid, "deflated": g.json.data, "crc32": g.json.crc}
            for g, sid in zip(groups, segment_ids)
        ]
        rows = [_row(g, state, sid, self._now) for g, sid in zip(groups, segment_ids)]
        _insert_many(self._conn, SEGMENTS, segments)
        _insert_many(self._conn, GROUPS, rows)
        self.stored += [(sid, g.env_id) for g, sid in zip(groups, segment_ids)]

    def _buffer(self, group: NewGroup, env_id: int, group_size: int) -> Placed:
        if env_id not in self._locked:
            # One transaction at a time works on an env's buffer (PostgreSQL; SQLite
            # has one writer anyway), so two halves of a group always meet.
            env_row = sa.select(ENVS.c.env_id).where(ENVS.c.env_id == env_id)
            self._conn.execute(for_update(env_row, self._dialect))
            self._locked.add(env_id)
        self._insert([group], AtroposGroupState.BUFFERED)
        buffered = self._conn.execute(
            sa.select(GROUPS.c.id, GROUPS.c.size)
            .where(GROUPS.c.state == AtroposGroupState.BUFFERED, GROUPS.c.env_id == env_id)
            .order_by(GROUPS.c.id)
        ).all()
        chosen = groups_summing_to([row.size for row in buffered], group_size)
        released = [buffered[i].id for i in chosen]
        for group_id in released:  # a new row each, so that the queue order is release order
            self._conn.execute(sa.insert(GROUPS).from_select(_COPIED, _copy_of(group_id)))
        if released:
            self._conn.execute(
                sa.delete(GROUPS).where(
                    GROUPS.c.id.in_(released), GROUPS.c.state == AtroposGroupState.BUFFERED
                )
            )
        left = sum(row.size for i, row in enumerate(buffered) if i not in set(chosen))
        return Placed(buffered=True, buffer_size=left)


_COPIED = ["state", "env_id", "size", "bytes", "fill_logprobs", "segment_id", "created_at"]


def _copy_of(group_id: int) -> sa.Select[Any]:
    return sa.select(
        sa.literal(GROUP_STATES.enter(AtroposGroupState.QUEUED), sa.String(16)),
        GROUPS.c.env_id,
        GROUPS.c.size,
        GROUPS.c.bytes,
        GROUPS.c.fill_logprobs,
        GROUPS.c.segment_id,
        GROUPS.c.created_at,
    ).where(GROUPS.c.id == group_id)


def _insert_many(conn: sa.Connection, table: sa.Table, rows: list[dict[str, Any]]) -> None:
    """Multi-row INSERTs: one statement per 1,000 rows instead of one per row, because
    this runs in a thread that gives up the GIL at every statement and may wait for
    it again each time. With RETURNING, SQLAlchemy sends the rows so ("insertmanyvalues")
    from SQL it compiled once; `.values(rows)` would be compiled anew on every call,
    the largest part of a commit's CPU."""
    conn.execute(sa.insert(table).returning(table.c.id), rows)


def _row(
    group: NewGroup, state: AtroposGroupState, segment_id: int, now: datetime
) -> dict[str, Any]:
    return {
        "state": GROUP_STATES.enter(state),
        "env_id": group.env_id,
        "size": group.size,
        "bytes": group.nbytes,
        "fill_logprobs": group.fill_logprobs,
        "segment_id": segment_id,
        "created_at": now,
    }


def fits(config: AtroposConfig, groups: int, nbytes: int) -> bool:
    """Whether `groups` of `nbytes` waiting are within the queue's bound."""
    limit_bytes = config.queue_max_bytes
    return groups <= config.queue_max_groups and (limit_bytes is None or nbytes <= limit_bytes)


def has_room(conn: sa.Connection, config: AtroposConfig, group: NewGroup) -> bool:
    """Whether `group` fits the queue's bound beside what waits now."""
    groups, nbytes = _waiting(conn)
    return fits(config, groups + 1, nbytes + group.nbytes)


def enqueue(conn: sa.Connection, dialect: Dialect, group: NewGroup) -> None:
    """Put a group straight in the queue, whatever its size: the hub's own groups
    (app/atropos/hub_env.py), which a buffer would hold back rather than release."""
    _Placer(conn, dialect, {})._insert([group], AtroposGroupState.QUEUED)


async def latest_group(db: AtroposDb) -> Segment | None:
    """The JSON of the newest group that entered the queue (atroposlib's latest
    example): the highest id not in a buffer; served groups keep it until a newer one
    arrives."""

    def work(conn: sa.Connection) -> Segment | None:
        row = conn.execute(
            sa.select(SEGMENTS.c.deflated, SEGMENTS.c.crc32, GROUPS.c.bytes)
            .join(GROUPS, GROUPS.c.segment_id == SEGMENTS.c.id)
            .where(GROUPS.c.state != AtroposGroupState.BUFFERED)
            .order_by(GROUPS.c.id.desc())
            .limit(1)
        ).first()
        return Segment(row.deflated, row.crc32, row.bytes) if row else None

    return await db.read(work)


def _to_trajectories(conn: sa.Connection, stored: list[tuple[int, int | None]]) -> None:
    """Mark the groups just stored for the stage that makes them trajectories
    (app/stages/env_groups.py): a small row each, in the same transaction, so that no
    group is missed and /scored_data does no more than that."""
    if not stored:
        return
    step = conn.execute(_STEP).scalar_one()
    now = utcnow()
    conn.execute(sa.insert(ENV_GROUPS), [
        {"segment_id": sid, "env_id": env_id, "step": step, "received_at": now}
        for sid, env_id in stored
    ])


def _waiting(conn: sa.Connection) -> tuple[int, int]:
    row = conn.execute(_WAITING).one()
    return int(row[0]), int(row[1])


def _group_sizes(conn: sa.Connection) -> dict[int, int]:
    return {env_id: size for env_id, size in conn.execute(_GROUP_SIZES)}


# Built once: the statements of every commit keep their compiled form cached.
_WAITING = sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(GROUPS.c.bytes), 0)).where(
    GROUPS.c.state.in_(WAITING)
)
_GROUP_SIZES = sa.select(ENVS.c.env_id, ENVS.c.group_size)
_STEP = sa.select(STATE.c.step).where(STATE.c.id == 1)
