"""Waiting on a condition with a deadline: the one way tests synchronise with a hub, a
process or a thread (never a bare sleep)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")
POLL = 0.05


def wait_until(check: Callable[[], T], timeout: float = 30, what: str = "condition",
               poll: float = POLL) -> T:
    """The first truthy value of `check()`, polled until `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; "
                                 f"last value {value!r}")
        time.sleep(poll)


@overload
async def wait_until_async(check: Callable[[], Awaitable[T]], timeout: float = 30,
                           what: str = "condition", poll: float = POLL) -> T: ...
@overload
async def wait_until_async(check: Callable[[], T], timeout: float = 30,
                           what: str = "condition", poll: float = POLL) -> T: ...
async def wait_until_async(check: Callable[[], Any], timeout: float = 30,
                           what: str = "condition", poll: float = POLL) -> Any:
    """wait_until for async tests: the event loop runs on while it waits."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; "
                                 f"last value {value!r}")
        await asyncio.sleep(poll)
