"""`atropos batches retry`: training batches (app.db.batch_queries)."""

from __future__ import annotations

import argparse
import sys

from app.cli.options import Commands, command
from app.config import load_config
from app.db.batch_queries import retry_batch
from app.errors import HubError
from app.hub import database


def register(commands: Commands[argparse.ArgumentParser]) -> None:
    group = commands.add_parser("batches", help="training batches")
    batch_commands = group.add_subparsers(dest="batches_command", required=True)
    retry = command(batch_commands, "retry", _retry, help="re-queue a failed batch")
    retry.add_argument("batch_id")


async def _retry(args: argparse.Namespace) -> int:
    async with database(load_config(args.config)) as engine:
        try:
            batch = await retry_batch(engine, args.batch_id)
        except HubError as exc:
            print(f"error: {exc.message}", file=sys.stderr)
            return 1
    print(f"batch {batch['batch_id']} is pending again (last error: {batch['last_error']})")
    return 0
