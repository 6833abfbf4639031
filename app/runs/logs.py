"""Where a run's processes write their output, and reading the end of it back."""

from __future__ import annotations

import os
from pathlib import Path

_BLOCK = 64 * 1024


def log_path(logs_dir: str, role: str, run_id: str) -> Path:
    """{logs_dir}/{trainer|env_N}_{run_id}.log, as Hermes names them."""
    return Path(logs_dir) / f"{role}_{run_id}.log"


def tail(path: Path, lines: int) -> list[str]:
    """The last `lines` lines of the file (fewer if it is shorter; none if it is
    missing). Reads from the end, so a training log of gigabytes costs a few blocks."""
    if lines <= 0:
        return []
    data = b""
    try:
        with open(path, "rb") as f:
            position = f.seek(0, os.SEEK_END)
            # One newline more than asked for: the first line read may be cut.
            while position > 0 and data.count(b"\n") <= lines:
                step = min(_BLOCK, position)
                position -= step
                f.seek(position)
                data = f.read(step) + data
    except FileNotFoundError:
        return []
    text = data.decode("utf-8", errors="replace")
    return text.splitlines()[-lines:]
