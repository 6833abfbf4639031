"""A token bucket per client (an API key, or an address while auth is off).

Each bucket holds up to `burst` tokens and refills at `rate` per second; a request
takes one. The buckets live in the process: with several hub processes behind one
address, each allows `rate` (docs/access.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class RateLimiter:
    def __init__(
        self, rate: float, burst: int | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.burst = float(burst if burst is not None else max(1, math.ceil(rate)))
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, when)

    def take(self, client: str) -> float:
        """Take a token: 0.0 if there was one, else the seconds until there is."""
        now = self._clock()
        tokens, then = self._buckets.get(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if tokens >= 1:
            self._buckets[client] = (tokens - 1, now)
            self._forget_idle(now)
            return 0.0
        self._buckets[client] = (tokens, now)
        return (1 - tokens) / self.rate

    def _forget_idle(self, now: float) -> None:
        # A full bucket is the same as no bucket: drop those so that many one-off
        # clients do not grow the table without end.
        if len(self._buckets) <= 10_000:
            return
        refill = self.burst / self.rate
        self._buckets = {
            client: state for client, state in self._buckets.items() if now - state[1] < refill
        }
