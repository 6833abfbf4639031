"""The gateway's captures, committed in groups: the calls that finish while a
transaction runs are written together in the next one, and each call's answer goes
out once its capture is committed (`write` returns then)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from functools import partial

from sqlalchemy.ext.asyncio import AsyncEngine

from app.db.dialect import OneHop
from app.db.errors import outage_of
from app.errors import Unavailable
from app.gateway import store
from app.gateway.store import Captured

log = logging.getLogger("atropos.gateway")

# Calls per transaction at most (bounds its memory).
_MAX_CALLS_PER_COMMIT = 1024


class CallWriter:
    def __init__(self, engine: AsyncEngine, retry_after: int) -> None:
        self._hop = OneHop(engine)
        self._outage = outage_of(engine)
        self._retry_after = retry_after
        self._queue: deque[tuple[Captured, asyncio.Future[None]]] = deque()
        self._writer: asyncio.Task[None] | None = None
        self._failed_at: float | None = None  # the last failed write, until one works
        self._detached: set[asyncio.Task[None]] = set()

    def failing(self) -> bool:
        """True while the last write failed, for `retry_after` seconds after it: calls
        are refused before the upstream is asked (then one is let through to try)."""
        failed = self._failed_at
        return failed is not None and time.monotonic() - failed < self._retry_after

    async def write(self, call: Captured) -> None:
        """Returns once `call` is committed; Unavailable when the database refused it."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((call, done))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write(), name="gateway-call-writer")
        await asyncio.shield(done)  # a client gone mid-write does not stop it

    def detach(self, call: Captured) -> None:
        """Write `call` without a waiter (the agent that made it has gone); close()
        waits for it."""
        task = asyncio.get_running_loop().create_task(self._quietly(call))
        self._detached.add(task)
        task.add_done_callback(self._detached.discard)

    async def _quietly(self, call: Captured) -> None:
        try:
            await self.write(call)
        except Unavailable:
            log.warning("the capture of a call of rollout %s was not stored: the database "
                        "refused it (its agent had gone already)", call.rollout_id)

    async def _write(self) -> None:
        while self._queue:
            batch = [self._queue.popleft()
                     for _ in range(min(len(self._queue), _MAX_CALLS_PER_COMMIT))]
            try:
                await self._hop.run(partial(store.write, calls=[c for c, _ in batch]))
            except Exception as exc:  # the batch failed as a whole: nobody was answered
                if not self._outage.failed(exc, "storing gateway calls"):
                    log.exception("storing %d gateway calls failed", len(batch))
                self._failed_at = time.monotonic()
                failure = Unavailable("the hub could not store this call's capture; retry",
                                      retry_after=self._retry_after)
                for _, done in batch:
                    if not done.done():
                        done.set_exception(failure)
            else:
                self._outage.works()
                self._failed_at = None
                for _, done in batch:
                    if not done.done():
                        done.set_result(None)

    async def close(self) -> None:
        if self._detached:
            await asyncio.gather(*self._detached, return_exceptions=True)
        if self._writer is not None:
            await self._writer
        await self._hop.close()
