"""`atropos batches list|retry`: training batches (app.db.batch_queries)."""

from __future__ import annotations

import argparse
import sys

from app.cli.options import Commands, command, group
from app.config import load_config
from app.db.batch_queries import list_batches, retry_batch, retry_failed_batches
from app.db.migrate import database
from app.domain import BatchState
from app.errors import ConfigError, HubError


def register(commands: Commands[argparse.ArgumentParser]) -> None:
    batch_commands = group(commands, "batches",
                           example="atropos batches list --config config.json --state failed")
    listing = command(batch_commands, "list", _list, help="the newest batches, one per line",
                      example="atropos batches list --config config.json --state failed")
    listing.add_argument("--state", choices=[state.value for state in BatchState],
                         help="only batches in this state")
    listing.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    retry = command(batch_commands, "retry", _retry, help="re-queue failed batches",
                    example="atropos batches retry --config config.json --all-failed")
    retry.add_argument("batch_id", nargs="?", help="the failed batch to re-queue")
    retry.add_argument("--all-failed", action="store_true", help="every failed batch")


async def _list(args: argparse.Namespace) -> int:
    if not 1 <= args.limit <= 1000:
        raise ConfigError("--limit: between 1 and 1000")
    async with database(load_config(args.config)) as engine, engine.connect() as conn:
        state = BatchState(args.state) if args.state else None
        batches, more = await list_batches(conn, state, args.limit, None)
    if not batches:
        print("no batches" + (f" {args.state}" if args.state else ""))
    for batch in batches:
        error = f"  {batch['last_error']}" if batch["last_error"] else ""
        print(f"{batch['batch_id']}  {batch['state']:<9} {batch['size']:>5} traces  "
              f"{batch['target']}  attempts {batch['attempts']}  {batch['created_at']}{error}")
    if more:
        print(f"(the newest {args.limit}; --limit for more)")
    return 0


async def _retry(args: argparse.Namespace) -> int:
    if bool(args.batch_id) == args.all_failed:
        raise ConfigError("batches retry: name one BATCH_ID or pass --all-failed")
    async with database(load_config(args.config)) as engine:
        if args.all_failed:
            ids = await retry_failed_batches(engine)
            print(f"{len(ids)} failed batches are pending again" + "".join(f"\n  {i}" for i in ids))
            return 0
        try:
            batch = await retry_batch(engine, args.batch_id)
        except HubError as exc:
            print(f"error: {exc.message}", file=sys.stderr)
            return 1
    print(f"batch {batch['batch_id']} is pending again (last error: {batch['last_error']})")
    return 0
