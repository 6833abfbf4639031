"""Admission to the write path: how the hub says "not now" (503 + Retry-After) instead
of queueing work it cannot write, or letting requests time out.

Two signals, both from config.json's `limits`: the traces admitted but not yet
committed (parsing, scoring or waiting for the group commit) past
`max_queued_traces`; and the write transaction in progress having waited longer than
`max_write_wait_seconds` (another process holds the database lock, or the disk is
stalled), when anything queued now would only wait behind it. An admitted trace's
own wait for its commit is bounded by the same limit in the inserter
(app/ingest/inserter.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from app.config import LimitsConfig
from app.errors import Unavailable


class Admission:
    def __init__(self, limits: LimitsConfig, write_wait: Callable[[], float]) -> None:
        self._limits = limits
        # Each writer's: seconds its current write has run; 0 when idle.
        self._write_waits = [write_wait]
        self.pending = 0

    def watch(self, write_wait: Callable[[], float]) -> None:
        """Another writer whose stalls turn work away too (OTLP spans)."""
        self._write_waits.append(write_wait)

    @contextmanager
    def admit(self, traces: int) -> Iterator[None]:
        """Hold `traces` places on the write path for the duration of the block."""
        limits = self._limits
        waited = max(write_wait() for write_wait in self._write_waits)
        if waited > limits.max_write_wait_seconds:
            raise Unavailable(
                f"the database has not finished a write for {waited:.1f} s "
                f"(limits.max_write_wait_seconds is {limits.max_write_wait_seconds:g}); "
                "retry shortly",
                retry_after=limits.retry_after_seconds,
                code="overloaded",
                field="limits.max_write_wait_seconds",
            )
        if self.pending + traces > limits.max_queued_traces:
            raise Unavailable(
                f"{self.pending} traces are waiting to be written "
                f"(limits.max_queued_traces is {limits.max_queued_traces}); retry shortly",
                retry_after=limits.retry_after_seconds,
                code="overloaded",
                field="limits.max_queued_traces",
            )
        self.pending += traces
        try:
            yield
        finally:
            self.pending -= traces
