"""Which envs count: those heard from lately.

atroposlib's `BaseEnv` never calls /disconnect-env, so an env process that died stays
registered, and its minimum allocation would hold every batch back. An env counts
(its weight in `env_weight`, its minimum allocation in batch formation and in
`unallocated_fraction`) while it is connected and was heard from within
`atropos.env_timeout_seconds`; a silent env counts again, under its id, as soon as
it is heard from. Heard from: its registration, a /scored_data or /scored_data_list
group naming it, its /status-env.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import datetime, timedelta

import sqlalchemy as sa

from app.atropos.tables import ENVS
from app.db.dialect import dialect_of, picked_once

# last_seen_at is written at most this often per env and hub (a fraction of the
# timeout), so that an env polling /status-env does not cost a commit each time.
_MAX_RESOLUTION = 1.0


def counts(connected: bool, last_seen: datetime, now: datetime, timeout: float) -> bool:
    return connected and now - last_seen <= timedelta(seconds=timeout)


def record(conn: sa.Connection, env_ids: Iterable[int], now: datetime) -> None:
    """last_seen_at = now. An env row another transaction holds (PostgreSQL: another
    hub storing its groups, which records it too) is passed over, not waited for: a
    group commit never waits on, or deadlocks with, another over an env's row."""
    ids = sorted(set(env_ids))
    if ids:
        free = picked_once(sa.select(ENVS.c.env_id).where(ENVS.c.env_id.in_(ids)), dialect_of(conn))
        conn.execute(
            sa.update(ENVS)
            .where(ENVS.c.env_id.in_(sa.select(free.c.env_id)))
            .values(last_seen_at=now)
        )


class Presence:
    """Which envs are due a new last_seen_at. Per process: hubs sharing a database
    each write their own, which only makes the value fresher."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._resolution = min(_MAX_RESOLUTION, timeout / 10)
        self._written: dict[int, float] = {}

    def due(self, env_ids: Iterable[int | None]) -> list[int]:
        """Those of env_ids whose last_seen_at is older than the resolution, marked
        as written from now on (the caller writes them in its transaction)."""
        now = time.monotonic()
        due = []
        for env_id in env_ids:
            if env_id is not None and now - self._written.get(env_id, -1e18) >= self._resolution:
                self._written[env_id] = now
                due.append(env_id)
        return due
