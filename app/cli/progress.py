"""A small progress line on stderr for long commands (import, rescore, export): one
redrawn line on a terminal, a line every few seconds otherwise (logs, CI)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, what: str, total: int | None = None, stream: TextIO = sys.stderr) -> None:
        self._what = what
        self._total = total
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
        of = f"/{self._total}" if self._total is not None else ""
        line = f"{self._what}: {self._done}{of} ({rate:.0f}/s, {elapsed:.1f} s)"
        if self._tty:
            self._stream.write("\r" + line + ("\n" if final else ""))
        else:
            self._stream.write(line + "\n")
        self._stream.flush()
