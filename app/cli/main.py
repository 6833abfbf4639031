"""The `atropos` command: a thin layer that loads the config files once and hands
them to the hub. Every command that opens the database migrates it first."""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from app.cli import logs
from app.cli.options import COMMANDS, find_config

# What `atropos --help` lists, in this order. Only the module of the command given is
# imported: the others pull in the whole hub, seconds before `--help` could answer.
_MODULES = ("serve", "importer", "rescore", "train", "export", "doctor", "batches", "prune",
            "keys", "run", "db", "init")


def main(argv: list[str] | None = None) -> None:
    args = build_parser(sys.argv[1:] if argv is None else argv).parse_args(argv)
    debug = getattr(args, "debug", False) or os.environ.get("ATROPOS_DEBUG") == "1"
    from app.errors import StartupError

    try:
        _find_files(args)
        logs.setup(_log_level(args), getattr(args, "log_format", "text"))
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            code = runner.run(args.run(args))
    except StartupError as exc:
        # One line saying what failed and what to do; the traceback only on request.
        if debug:
            traceback.print_exception(exc, file=sys.stderr)
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where it is installed (it comes with uvicorn[standard]): the HTTP path
    spends a good part of its time in the event loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of `atropos`; with `argv`, fully declared only for the command it
    names (the others are listed by name and purpose), so that it is built at once."""
    parser = argparse.ArgumentParser(
        prog="atropos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Each command's --help lists its options and ends with an example.\n\n"
               "example:\n  atropos serve --config config.json",
    )
    parser.add_argument("--version", action=_Version, help="show the version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = _chosen(argv) if argv is not None else None
    for module in _MODULES:
        names = [name for name, (home, _) in COMMANDS.items() if home == module]
        if argv is None or chosen in names:
            _imported(module).register(commands)
        else:
            for name in names:
                commands.add_parser(name, help=COMMANDS[name][1])
    return parser


def _imported(module: str) -> Any:
    # Importing the hub allocates hundreds of thousands of objects and frees none: the
    # collector's passes meanwhile are time lost from start-up (a restarted hub must
    # answer within a second; docs/atropos.md, "Start-up"). Frozen before it is turned
    # back on, or its first pass after would walk all of them.
    gc.disable()
    try:
        return importlib.import_module(f"app.cli.{module}")
    finally:
        gc.freeze()
        gc.enable()


class _Version(argparse.Action):
    """--version, its answer looked up only when asked (the package metadata takes a
    while to read, and every other command would pay for it)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"atropos-hub {_version()}")
        parser.exit()


def _chosen(argv: Sequence[str]) -> str | None:
    return next((word for word in argv if not word.startswith("-")), None)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("atropos-hub")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _find_files(args: argparse.Namespace) -> None:
    """The config files a command reads, where it was given none: see find_config."""
    for option, name in (("config", getattr(args, "config_file", None)),
                         ("compression", "compression.json"), ("tinker", "tinker.json")):
        if name is not None and hasattr(args, option):
            setattr(args, option, find_config(getattr(args, option), name))


def _log_level(args: argparse.Namespace) -> str:
    """--log-level, else the config file's trace_server.log_level, else INFO. A config
    file that cannot be loaded is the command's to report, with its one line."""
    from app.config import load_config
    from app.errors import StartupError

    if getattr(args, "log_level", None):
        return str(args.log_level)
    if getattr(args, "config_file", None) == "config.json":
        try:
            return load_config(args.config).trace_server.log_level
        except StartupError:
            pass
    return "INFO"
