"""Run records in the database: the state machine, and reading runs back.

A run lives in the database, not in the hub's memory, so that a restarted hub (or
another one sharing the database) knows every run and what became of it. Status
moves are `UPDATE ... WHERE status IN (:expected)` (app/db/moves.py): whoever moves
second sees it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from app.db.models import RUN_PROCESSES as PROCESSES
from app.db.models import RUNS
from app.db.moves import StateMachine
from app.db.types import utcnow
from app.errors import NotFound


class RunStatus(StrEnum):
    """pending -> starting -> running -> completed | failed | stopped.

    pending: recorded, nothing started yet. starting: processes are being started, one
    after the other, each waited for by its health check. running: all are up and
    watched every poll_interval. stopping: a stop was asked for (DELETE); processes are
    being stopped, environments first. completed: the trainer exited 0. failed: a
    process exited otherwise, did not get healthy, or was gone after a hub restart;
    error_message says which and where its log is. stopped: stopped on request.
    """

    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def finished(self) -> bool:
        return not TRANSITIONS[self]


TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.PENDING: frozenset({RunStatus.STARTING, RunStatus.STOPPING, RunStatus.FAILED}),
    RunStatus.STARTING: frozenset({RunStatus.RUNNING, RunStatus.STOPPING, RunStatus.FAILED}),
    RunStatus.RUNNING: frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.STOPPING}),
    # A trainer that had already ended when the stop came keeps its own outcome.
    RunStatus.STOPPING: frozenset({RunStatus.STOPPED, RunStatus.COMPLETED, RunStatus.FAILED}),
    RunStatus.COMPLETED: frozenset(),
    RunStatus.FAILED: frozenset(),
    RunStatus.STOPPED: frozenset(),
}

ACTIVE = [status for status in RunStatus if not status.finished]
RUN_STATUSES: StateMachine[RunStatus] = StateMachine(
    "run", RUNS.c.status, TRANSITIONS, entries={RunStatus.PENDING}
)


@dataclass(frozen=True)
class ProcessRecord:
    position: int
    role: str
    command: list[str]
    log_path: str
    pid: int | None
    start_ticks: int | None
    started_at: datetime | None
    healthy_at: datetime | None
    exited_at: datetime | None
    exit_code: int | None

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "command": self.command,
            "pid": self.pid,
            "exit_code": self.exit_code,
            "log_path": self.log_path,
            "started_at": _iso(self.started_at),
            "healthy_at": _iso(self.healthy_at),
            "exited_at": _iso(self.exited_at),
        }


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    status: RunStatus
    error_message: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    spec: dict[str, Any]
    host: str
    supervisor: str | None
    processes: list[ProcessRecord]

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "status": self.status.value,
            "error_message": self.error_message,
            "created_at": self.created_at.isoformat(),
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
            "host": self.host,
            "spec": self.spec,
            "processes": [p.to_json() for p in self.processes],
        }


async def create_run(
    conn: AsyncConnection,
    run_id: str,
    spec: dict[str, Any],
    processes: Sequence[tuple[str, list[str], str]],
    *,
    host: str,
    supervisor: str,
) -> None:
    """A pending run and its processes, (role, command, log_path) in start order."""
    now = utcnow()
    await conn.execute(
        sa.insert(RUNS).values(
            run_id=run_id,
            status=RUN_STATUSES.enter(RunStatus.PENDING),
            created_at=now,
            updated_at=now,
            spec=spec,
            host=host,
            supervisor=supervisor,
        )
    )
    await conn.execute(
        sa.insert(PROCESSES),
        [
            {"run_id": run_id, "position": i, "role": role, "command": command, "log_path": path}
            for i, (role, command, path) in enumerate(processes)
        ],
    )


async def move(
    conn: AsyncConnection,
    run_id: str,
    target: RunStatus,
    *,
    expected: Iterable[RunStatus] | None = None,
    error_message: str | None = None,
) -> bool:
    """Move the run to `target` if it is in one of `expected` (default: any status
    that may move there); False if it was not (someone else moved it first)."""
    now = utcnow()
    values: dict[str, Any] = {"updated_at": now}
    if error_message is not None:
        values["error_message"] = error_message
    if target == RunStatus.RUNNING:
        values["started_at"] = now
    if target.finished:
        values["finished_at"] = now
    result = await conn.execute(
        RUN_STATUSES.move(target, expected=expected)
        .where(RUNS.c.run_id == run_id)
        .values(**values)
    )
    return result.rowcount == 1


async def update_process(conn: AsyncConnection, run_id: str, position: int, **values: Any) -> None:
    await conn.execute(
        sa.update(PROCESSES)
        .where(PROCESSES.c.run_id == run_id, PROCESSES.c.position == position)
        .values(**values)
    )


async def record_exit(conn: AsyncConnection, run_id: str, position: int, code: int | None) -> None:
    """The process's exit code, unless one was recorded already (a hub that stopped
    it knew more than one that finds it gone)."""
    await conn.execute(
        sa.update(PROCESSES)
        .where(
            PROCESSES.c.run_id == run_id,
            PROCESSES.c.position == position,
            PROCESSES.c.exited_at.is_(None),
        )
        .values(exit_code=code, exited_at=utcnow())
    )


async def status_of(conn: AsyncConnection, run_id: str) -> RunStatus:
    status = await conn.scalar(sa.select(RUNS.c.status).where(RUNS.c.run_id == run_id))
    if status is None:
        raise _not_found(run_id)
    return RunStatus(status)


async def get_run(conn: AsyncConnection, run_id: str) -> RunRecord:
    records = await _load(conn, RUNS.c.run_id == run_id, limit=1)
    if not records:
        raise _not_found(run_id)
    return records[0]


async def list_runs(conn: AsyncConnection, status: RunStatus | None, limit: int) -> list[RunRecord]:
    """Newest first."""
    where = RUNS.c.status == status.value if status is not None else sa.true()
    return await _load(conn, where, limit=limit)


async def unwatched_runs(conn: AsyncConnection, host: str, me: str) -> list[tuple[str, str | None]]:
    """(run_id, supervisor) of the runs on `host` that have not finished and that
    this hub does not watch."""
    rows = await conn.execute(
        sa.select(RUNS.c.run_id, RUNS.c.supervisor)
        .where(
            RUNS.c.host == host,
            RUNS.c.status.in_([s.value for s in ACTIVE]),
            sa.or_(RUNS.c.supervisor.is_(None), RUNS.c.supervisor != me),
        )
        .order_by(RUNS.c.created_at)
    )
    return [(run_id, supervisor) for run_id, supervisor in rows]


async def claim(conn: AsyncConnection, run_id: str, previous: str | None, me: str) -> bool:
    """Take over watching the run, unless another hub took it first."""
    owner = RUNS.c.supervisor
    result = await conn.execute(
        sa.update(RUNS)
        .where(
            RUNS.c.run_id == run_id,
            owner.is_(None) if previous is None else owner == previous,
        )
        .values(supervisor=me)
    )
    return result.rowcount == 1


async def release(conn: AsyncConnection, me: str) -> None:
    """The hub stops watching its runs (they keep running); the next hub takes them."""
    await conn.execute(
        sa.update(RUNS)
        .where(RUNS.c.supervisor == me, RUNS.c.status.in_([s.value for s in ACTIVE]))
        .values(supervisor=None)
    )


async def _load(
    conn: AsyncConnection, where: sa.ColumnElement[bool], *, limit: int
) -> list[RunRecord]:
    runs = (
        await conn.execute(
            sa.select(RUNS)
            .where(where)
            .order_by(RUNS.c.created_at.desc(), RUNS.c.run_id.desc())
            .limit(limit)
        )
    ).all()
    if not runs:
        return []
    processes: dict[str, list[ProcessRecord]] = {run.run_id: [] for run in runs}
    rows = await conn.execute(
        sa.select(PROCESSES)
        .where(PROCESSES.c.run_id.in_(list(processes)))
        .order_by(PROCESSES.c.run_id, PROCESSES.c.position)
    )
    for row in rows:
        processes[row.run_id].append(
            ProcessRecord(
                position=row.position,
                role=row.role,
                command=row.command,
                log_path=row.log_path,
                pid=row.pid,
                start_ticks=row.start_ticks,
                started_at=row.started_at,
                healthy_at=row.healthy_at,
                exited_at=row.exited_at,
                exit_code=row.exit_code,
            )
        )
    return [
        RunRecord(
            run_id=run.run_id,
            status=RunStatus(run.status),
            error_message=run.error_message,
            created_at=run.created_at,
            started_at=run.started_at,
            finished_at=run.finished_at,
            spec=run.spec,
            host=run.host,
            supervisor=run.supervisor,
            processes=processes[run.run_id],
        )
        for run in runs
    ]


def _not_found(run_id: str) -> NotFound:
    return NotFound(f"no run with run_id {run_id!r}", field="run_id")


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None
