"""The `atropos` command: a thin layer that loads the config files once and hands
them to the hub. Every command that opens the database migrates it first."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import traceback
from collections.abc import Callable

from app.cli import (
    batches,
    db,
    doctor,
    export,
    importer,
    keys,
    logs,
    prune,
    rescore,
    run,
    serve,
    train,
)
from app.config import load_config
from app.errors import StartupError

# Each module declares its commands; `atropos --help` lists them in this order.
_COMMAND_GROUPS = (serve, importer, rescore, train, export, doctor, batches, prune, keys, run, db)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = getattr(args, "debug", False) or os.environ.get("ATROPOS_DEBUG") == "1"
    try:
        logs.setup(_log_level(args), getattr(args, "log_format", "text"))
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            code = runner.run(args.run(args))
    except StartupError as exc:
        # One line saying what failed and what to do; the traceback only on request.
        if debug:
            traceback.print_exception(exc, file=sys.stderr)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atropos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Each command's --help lists its options and ends with an example.\n\n"
               "example:\n  atropos serve --config config.json",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for group in _COMMAND_GROUPS:
        group.register(commands)
    return parser


def _log_level(args: argparse.Namespace) -> str:
    """--log-level, else the config file's trace_server.log_level, else INFO. A config
    file that cannot be loaded is the command's to report, with its one line."""
    if getattr(args, "log_level", None):
        return str(args.log_level)
    if getattr(args, "config", None):
        try:
            return load_config(args.config).trace_server.log_level
        except StartupError:
            pass
    return "INFO"
