"""Where a run's processes write their output, and reading the end of it back."""

from __future__ import annotations

import os
from pathlib import Path

_BLOCK = 64 * 1024
# The most a tail reads from the end of one log, and so the most it answers per log.
TAIL_MAX_BYTES = 256 * 1024


def log_path(logs_dir: str, role: str, run_id: str) -> Path:
    """{logs_dir}/{trainer|env_N}_{run_id}.log, as Hermes names them."""
    return Path(logs_dir) / f"{role}_{run_id}.log"


def tail(path: Path, lines: int) -> list[str]:
    """The last `lines` lines of the file (fewer if it is shorter; none if it is
    missing), from at most its last TAIL_MAX_BYTES: a training log of gigabytes, or one
    that never writes a newline, costs a few blocks, and a line longer than the bound
    comes back as its last TAIL_MAX_BYTES."""
    if lines <= 0:
        return []
    blocks: list[bytes] = []
    try:
        with open(path, "rb") as f:
            position = f.seek(0, os.SEEK_END)
            start = max(0, position - TAIL_MAX_BYTES)
            # One newline more than asked for: the first line read may be cut.
            newlines = 0
            while position > start and newlines <= lines:
                step = min(_BLOCK, position - start)
                position -= step
                f.seek(position)
                block = f.read(step)
                newlines += block.count(b"\n")
                blocks.append(block)
    except FileNotFoundError:
        return []
    text = b"".join(reversed(blocks)).decode("utf-8", errors="replace")
    return text.splitlines()[-lines:]
