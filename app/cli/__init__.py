"""The `atropos` command."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """`atropos`: Ctrl-C at any moment, even while the hub is still being imported, ends
    the command with exit 130 and no traceback (a command that was working has said
    what it did by then)."""
    try:
        from app.cli.main import main as run

        run(argv)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)


__all__ = ["main"]
