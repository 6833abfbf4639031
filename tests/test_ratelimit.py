"""The token bucket behind auth.rate_limit_per_second, on a clock the test moves."""

from __future__ import annotations

import pytest

from app.access.ratelimit import RateLimiter
from tests.support.clock import Clock


def test_burst_then_the_rate() -> None:
    clock = Clock()
    limiter = RateLimiter(2, burst=3, clock=clock)
    assert [limiter.take("k") for _ in range(3)] == [0, 0, 0]
    assert limiter.take("k") == pytest.approx(0.5)
    clock.now += 0.5
    assert limiter.take("k") == 0
    assert limiter.take("k") == pytest.approx(0.5)
    assert limiter.take("other") == 0  # each client has its own bucket
    clock.now += 60  # refills up to the burst, no further
    assert [limiter.take("k") for _ in range(4)][-1] > 0


def test_default_burst_is_one_second_of_rate() -> None:
    assert RateLimiter(0.5).burst == 1
    assert RateLimiter(7.2).burst == 8


def test_refused_requests_do_not_pile_up_debt() -> None:
    clock = Clock()
    limiter = RateLimiter(1, burst=1, clock=clock)
    limiter.take("k")
    for _ in range(50):
        assert limiter.take("k") == pytest.approx(1.0)
    clock.now += 1.0
    assert limiter.take("k") == 0


def test_idle_clients_are_forgotten() -> None:
    clock = Clock()
    limiter = RateLimiter(10, burst=10, clock=clock)
    for n in range(10_001):
        limiter.take(f"client-{n}")
    clock.now += 5
    limiter.take("late")
    assert len(limiter._buckets) == 1
