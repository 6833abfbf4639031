"""Waiting for an event with a timeout, in the loops of the stages, leases and runs."""

from __future__ import annotations

import asyncio


async def event_set_within(event: asyncio.Event, seconds: float) -> bool:
    """Whether `event` is set within `seconds`. Not asyncio.wait_for: on Python 3.11 it
    drops a cancellation that arrives as the event is set (CPython gh-86296), and a
    stage loop that lost one never stopped, so the hub's shutdown waited forever."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True
