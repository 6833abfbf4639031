"""What the commands share: how a command is declared with its common options, the
config files they name, and the option types (ages, durations)."""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.durations import parse_duration, parse_moment

if TYPE_CHECKING:
    from app.config import Settings

CommandHandler = Callable[[argparse.Namespace], Awaitable[int]]
Commands = argparse._SubParsersAction  # the subparsers of `atropos` or of a group

# Every command of `atropos`: the module (app/cli/<module>.py) that declares it, and
# what `atropos --help` says of it.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("serve", "run the HTTP API and the background stages"),
    "worker": ("serve", "run the background stages only"),
    "import": ("importer", "store trajectory files through the pipeline"),
    "rescore": ("rescore", "score stored traces with the current rules"),
    "recompress": ("rescore", "compress stored traces again with the current compression policy"),
    "train": ("train", "one training job from a dataset file"),
    "export": ("export", "stored traces to a training file or dataset"),
    "doctor": ("doctor", "check the model endpoint set-up"),
    "batches": ("batches", "training batches"),
    "prune": ("prune", "delete old traces (never one still on its way to training)"),
    "keys": ("keys", "API keys (auth.enabled)"),
    "run": ("run", "start a training run on a hub and follow it"),
    "db": ("db", "database operations"),
    "init": ("init", "write config.json, compression.json and tinker.json with every key"),
}
# Where a command looks for a config file it was not given, in order; then it runs on
# the built-in defaults.
CONFIG_FOLDERS = (Path("."), Path("~/.atropos"))


def find_config(given: str | None, name: str) -> str | None:
    """The file to read: the one given, else `name` in ./ or ~/.atropos/, else None
    (the built-in defaults)."""
    if given:
        return given
    for folder in CONFIG_FOLDERS:
        path = folder.expanduser() / name
        if path.is_file():
            return str(path)
    return None


def _looked_for(name: str) -> str:
    return f"default: ./{name}, else ~/.atropos/{name}, else the built-in defaults"


def command(
    commands: Commands[argparse.ArgumentParser],
    name: str,
    run: CommandHandler,
    *,
    example: str,
    config: str | None = "config.json",
    **parser: Any,
) -> argparse.ArgumentParser:
    """The subcommand `name`, which `run` carries out, with the options every command
    has: `--config` (the file it names, when it reads one), the log's level and format,
    and `--debug`. Its --help ends with `example`, a command line to copy."""
    if name in COMMANDS:
        parser.setdefault("help", COMMANDS[name][1])
    declared = commands.add_parser(name, **_with_example(parser, example))
    if config is not None:
        declared.add_argument("--config", help=f"{config} ({_looked_for(config)})")
        declared.set_defaults(config_file=config)
    declared.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        help="DEBUG, INFO, WARNING or ERROR (default: trace_server.log_level, else INFO)",
    )
    declared.add_argument(
        "--log-format", choices=("text", "json"), default="text",
        help="json: one JSON object per line (time, level, logger, message)",
    )
    declared.add_argument(
        "--debug", action="store_true",
        help="show the traceback behind an error (also: ATROPOS_DEBUG=1)",
    )
    declared.set_defaults(run=run)
    return declared


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def group(
    commands: Commands[argparse.ArgumentParser], name: str, *, example: str
) -> Commands[argparse.ArgumentParser]:
    """A command with subcommands (`atropos batches list`); returns where they go."""
    declared = commands.add_parser(name, help=COMMANDS[name][1], **_with_example({}, example))
    return declared.add_subparsers(dest=f"{name}_command", required=True)


def _with_example(parser: dict[str, Any], example: str) -> dict[str, Any]:
    """add_parser's keywords with `example` as the epilog, kept as written."""
    return {
        "formatter_class": argparse.RawDescriptionHelpFormatter,
        **parser,
        "epilog": f"example:\n  {example}",
    }


@contextmanager
def ctrl_c_stops() -> Iterator[asyncio.Event]:
    """While the block runs, Ctrl-C (SIGINT) sets the event it yields: the command
    stops after the work in hand and says what it did. A second Ctrl-C stops it at
    once (KeyboardInterrupt, exit 130)."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()

    def interrupted() -> None:
        stopping.set()
        loop.remove_signal_handler(signal.SIGINT)  # the next one interrupts

    loop.add_signal_handler(signal.SIGINT, interrupted)
    try:
        yield stopping
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def add_hub_files(parser: argparse.ArgumentParser) -> None:
    """The other two config files of a hub process, beside --config."""
    parser.add_argument("--compression",
                        help=f"compression.json ({_looked_for('compression.json')})")
    parser.add_argument("--tinker", help="tinker.json, the model and training endpoint "
                                         f"({_looked_for('tinker.json')})")


def load_settings(args: argparse.Namespace, *, delivers: bool = False) -> Settings:
    """The config files; `delivers`: this process will hand batches to the target."""
    from app.config import Settings, load_compression, load_config, load_tinker

    settings = Settings(
        load_config(args.config), load_compression(args.compression), load_tinker(args.tinker)
    )
    if delivers:
        _named_training_service(settings, args.config)
    return settings


def _named_training_service(settings: Settings, config: str | None) -> None:
    """The tinker target sends every batch to a training service: only to one the user
    named. tinker.json's own default (api.openai.com) is not naming one."""
    from app.errors import ConfigError

    if settings.config.distributor.target != "tinker":
        return
    if "base_url" in settings.tinker.tinker.model_fields_set:
        return
    raise ConfigError(
        f"{Path(config or 'config.json').name}: distributor.target is tinker, which sends "
        "every batch to a training service, but no tinker.json names one: pass --tinker FILE with "
        'tinker.base_url set, or deliver to "jsonl" (files in distributor.output_dir)'
    )


def add_since(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--since", type=moment,
                        help="only traces created since: an ISO date/time or an age (7d, 12h)")


def moment(value: str) -> datetime:
    """An ISO 8601 date or time (UTC unless it says otherwise), or an age: 30m, 12h, 7d."""
    try:
        return parse_moment(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def duration(value: str) -> timedelta:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def counted(n: int, noun: str) -> str:
    """`1 trace`, `2 traces`: a count with its noun in the right number."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
