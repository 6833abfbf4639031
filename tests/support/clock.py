"""A monotonic clock the test moves: handed to what would read time.monotonic, so that
a test waits for nothing to pass."""

from __future__ import annotations


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
