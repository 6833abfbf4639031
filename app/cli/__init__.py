"""The `atropos` command."""

from __future__ import annotations

import sys
import threading


def _loop_gone(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return True
        exc = exc.__context__
    return False


def _thread_failed(args: threading.ExceptHookArgs) -> None:
    """A database driver's worker thread answering an event loop that Ctrl-C closed
    (the process is ending) has nothing to tell the user; any other failure is shown."""
    if not _loop_gone(args.exc_value):
        threading.__excepthook__(args)


def main(argv: list[str] | None = None) -> None:
    """`atropos`: Ctrl-C at any moment, even while the hub is still being imported, ends
    the command with exit 130 and no traceback (a command that was working has said
    what it did by then)."""
    threading.excepthook = _thread_failed
    try:
        from app.cli.main import main as run

        run(argv)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)


__all__ = ["main"]
