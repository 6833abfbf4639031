"""A small progress line on stderr for long commands (import, rescore, export, prune):
on a terminal one redrawn line, with a bar when the total is known; otherwise (logs,
CI) a plain line every few seconds."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, what: str, total: int | None = None, stream: TextIO = sys.stderr) -> None:
        self._what = what
        self.total = total  # may be learnt later
        self._stream = stream
        self._tty = stream.isatty()
        self._done = 0
        self._started = self._shown = time.monotonic()

    def advance(self, n: int = 1) -> None:
        self._done += n
        now = time.monotonic()
        if now - self._shown >= (0.2 if self._tty else 5.0):
            self._shown = now
            self._show(final=False)

    def close(self) -> None:
        self._show(final=True)

    def _show(self, *, final: bool) -> None:
        elapsed = time.monotonic() - self._started
        rate = self._done / elapsed if elapsed > 0 else 0.0
        of = f"/{self.total}" if self.total is not None else ""
        line = f"{self._what}: {self._done}{of} ({rate:.0f}/s, {elapsed:.1f} s)"
        if self._tty and self.total:
            line = f"{self._bar(self._done / self.total)} {line}"
        if self._tty:
            self._stream.write("\r" + line + ("\n" if final else ""))
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    @staticmethod
    def _bar(fraction: float, width: int = 24) -> str:
        fraction = min(max(fraction, 0.0), 1.0)
        filled = round(fraction * width)
        return f"[{'#' * filled}{'.' * (width - filled)}] {fraction:4.0%}"
