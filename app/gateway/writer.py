"""The gateway's captures as a kind of the hub's group commit (app/db/group_commit.py):
the calls that finish while a transaction runs are written together in the next one,
and each call's answer goes out once its capture is committed.

Their commits are not synced (`OneHop.run`): a capture survives the hub's kill -9,
which is what an agent's answer is promised, without an fsync on every model call's
path; a power cut can lose those since the last synced commit or checkpoint."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import sqlalchemy as sa

from app.db.dialect import OneHop
from app.db.group_commit import GroupCommit
from app.errors import HubError
from app.gateway import store
from app.gateway.store import Captured
from app.outage import Outage

log = logging.getLogger("atropos.gateway")


class _Captures:
    name = "gateway captures"

    def write(self, conn: sa.Connection, items: Sequence[Captured]) -> list[None | HubError]:
        store.write(conn, items)
        return [None] * len(items)


class RecentConversations:
    """The rollouts of the conversations this hub's calls were last committed in, by
    the digest a call continuing each begins with (stitching.continuation): an agent's
    next turn, seconds later, finds its rollout here, without a query on its path.
    Bounded in number and age (a rollout may be pruned since); what is not here is
    looked up in the database, where every hub's captures are."""

    def __init__(self, size: int = 16_384, seconds: float = 600) -> None:
        self._size = size
        self._seconds = seconds
        self._rollouts: dict[str, tuple[str, float]] = {}  # digest -> (rollout, since)

    def committed(self, calls: list[Captured]) -> None:
        now = time.monotonic()
        for call in calls:
            if call.continues is not None:
                self._rollouts.pop(call.continues, None)  # to the end: the newest
                self._rollouts[call.continues] = (call.rollout_id, now)
        while len(self._rollouts) > self._size:
            del self._rollouts[next(iter(self._rollouts))]

    def continued(self, prefixes: list[str]) -> str | None:
        """The rollout a call of these prefix digests continues, if its longest prefix
        (its last call's conversation and answer, as an agent's loop sends it) is here:
        no longer one can be in the database."""
        found = self._rollouts.get(prefixes[0]) if prefixes else None
        if found is None or time.monotonic() - found[1] > self._seconds:
            return None
        return found[0]


class CallWriter:
    def __init__(self, writer: OneHop, outage: Outage, *, max_wait: float,
                 retry_after: int) -> None:
        self.recent = RecentConversations()
        self.commits: GroupCommit[Captured, None] = GroupCommit(
            _Captures(), writer, outage, max_wait=max_wait, retry_after=retry_after,
            on_commit=self.recent.committed, synced=False)
        self._detached: set[asyncio.Future[None]] = set()

    def start(self) -> None:
        self.commits.start()

    async def write(self, call: Captured) -> None:
        """Returns once `call` is committed; Unavailable (503) when it was not."""
        await asyncio.shield(self.commits.submit(call))  # an agent gone mid-write: kept

    def detach(self, call: Captured) -> None:
        """Write `call` without a waiter (the agent that made it has gone)."""
        done = self.commits.submit(call)
        self._detached.add(done)
        done.add_done_callback(self._written)

    def _written(self, done: asyncio.Future[None]) -> None:
        self._detached.discard(done)
        if not done.cancelled() and done.exception() is not None:
            log.warning("the capture of a call whose agent had gone was not stored: %s",
                        done.exception())

    async def close(self) -> None:
        await self.commits.stop()  # what is queued is written first
