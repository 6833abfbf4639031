"""`atropos prune`: delete old traces by age, reward and stage (app.stages.retention),
never one still on its way to training."""

from __future__ import annotations

import argparse
import sys

from app.cli.options import Commands, command, duration
from app.cli.progress import Progress
from app.config import load_config
from app.db.migrate import database
from app.domain import NEVER_PRUNED, Stage
from app.errors import ConfigError
from app.stages import retention


def register(commands: Commands[argparse.ArgumentParser]) -> None:
    prune = command(commands, "prune", _prune,
                    example="atropos prune --config config.json --older-than 30d "
                            "--max-reward 0 --dry-run")
    prune.add_argument(
        "--older-than", required=True, type=duration, help="e.g. 30d, 12h, 2w (created before)"
    )
    prune.add_argument(
        "--max-reward", type=float, help="only traces whose reward is below this (reward < R)"
    )
    prune.add_argument(
        "--stage",
        action="append",
        type=_prunable_stage,
        default=[],
        help="only traces in this stage (repeatable)",
    )
    prune.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    prune.add_argument("--yes", action="store_true",
                       help="delete without asking (required when stdin is not a terminal)")
    prune.add_argument("--batch-size", type=int, default=1000, help="traces per transaction")
    prune.add_argument(
        "--no-vacuum", action="store_true", help="SQLite: skip VACUUM (it locks writers out)"
    )


def _prunable_stage(value: str) -> Stage:
    try:
        stage = Stage(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown stage {value!r}; one of {', '.join(Stage)}"
        ) from None
    if stage in NEVER_PRUNED:
        raise argparse.ArgumentTypeError(f"{stage} traces wait for delivery; never pruned")
    return stage


async def _prune(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise ConfigError("--batch-size: must be at least 1")
    config = load_config(args.config)
    criteria = retention.Criteria(args.older_than, args.max_reward, tuple(args.stage))
    if not (args.dry_run or args.yes or sys.stdin.isatty()):
        raise ConfigError("prune: stdin is not a terminal to confirm on; pass --yes to delete "
                          "(or --dry-run to count)")
    async with database(config) as engine:
        if not (args.dry_run or args.yes):
            # Count first and ask: a mistyped --older-than would delete everything.
            counted = await retention.prune(engine, criteria, batch_size=args.batch_size,
                                            dry_run=True, vacuum=False)
            print(f"matching: {counted.matched} traces {criteria.describe()}")
            if counted.matched == 0:
                return 0
            if input(f"delete these {counted.matched} traces? [y/N] ").strip().lower() != "y":
                print("nothing deleted")
                return 1
        progress = Progress("deleted")

        def deleted(n: int, matched: int) -> None:
            progress.total = matched
            progress.advance(n)

        result = await retention.prune(
            engine,
            criteria,
            batch_size=args.batch_size,
            dry_run=args.dry_run,
            vacuum=not args.no_vacuum,
            on_deleted=deleted,
        )
        if result.deleted:
            progress.close()
    if args.dry_run or args.yes:  # else said before asking
        print(f"matching: {result.matched} traces {criteria.describe()}")
    if args.dry_run:
        print("dry run: nothing deleted")
        return 0
    print(f"deleted: {result.deleted} in {result.batches} batches")
    if result.maintenance:
        print(f"then: {', '.join(result.maintenance)}")
    return 0
