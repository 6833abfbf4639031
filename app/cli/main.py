"""The `atropos` command: a thin layer that loads the config files once and hands
them to the hub. Every command that opens the database migrates it first."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable

from app.cli import batches, db, doctor, export, importer, keys, prune, rescore, run, serve, train
from app.errors import StartupError

# Each module declares its commands; `atropos --help` lists them in this order.
_COMMAND_GROUPS = (serve, importer, rescore, train, export, doctor, batches, prune, keys, run, db)


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    _setup_logging()
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            code = runner.run(args.run(args))
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where it is installed (it comes with uvicorn[standard]): the HTTP path
    spends a good part of its time in the event loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atropos", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for group in _COMMAND_GROUPS:
        group.register(commands)
    return parser


def _setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    # Alembic narrates every migration step; our own line says which revision we reach.
    logging.getLogger("alembic").setLevel(logging.WARNING)
