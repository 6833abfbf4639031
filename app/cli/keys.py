"""`atropos keys create|list|revoke`: the API keys of app.access.keys."""

from __future__ import annotations

import argparse
import logging
import sys
from datetime import datetime

from app.access import keys
from app.cli.options import Commands, command, group
from app.config import load_config
from app.db.migrate import database
from app.errors import HubError

log = logging.getLogger("atropos")


def register(commands: Commands[argparse.ArgumentParser]) -> None:
    key_commands = group(commands, "keys",
                         example="atropos keys create --config config.json --scope ingest "
                                 "--name my-agent")
    create = command(key_commands, "create", _create,
                     help="make a key; prints it once, last line",
                     example="atropos keys create --config config.json --scope ingest "
                             "--name my-agent")
    create.add_argument(
        "--scope",
        action="append",
        required=True,
        choices=[s.value for s in keys.Scope],
        help="ingest, read, train or admin (admin includes the others; repeatable)",
    )
    create.add_argument("--name", required=True, help="who or what the key is for")
    command(key_commands, "list", _list, help="every key, revoked ones too",
            example="atropos keys list --config config.json")
    revoke = command(key_commands, "revoke", _revoke,
                     help="stops the key (within auth.key_cache_seconds)",
                     example="atropos keys revoke --config config.json KEY_ID")
    revoke.add_argument("key_id", help="the id shown by `atropos keys list`")


async def _create(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if not config.auth.enabled:
        log.warning("auth.enabled is false in %s: keys are not checked until it is true",
                    args.config)
    async with database(config) as engine:
        key, secret = await keys.create_key(engine, args.name, {keys.Scope(s) for s in args.scope})
    print(f"created API key {key.describe()}, scopes: {', '.join(sorted(key.scopes))}")
    print("it is shown only now; the hub keeps a hash of it:")
    print(secret)
    return 0


async def _list(args: argparse.Namespace) -> int:
    async with database(load_config(args.config)) as engine:
        found = await keys.list_keys(engine)
    print(f"{'KEY_ID':<14}{'NAME':<24}{'SCOPES':<20}{'CREATED':<22}STATUS")
    for key in found:
        status = f"revoked {_when(key.revoked_at)}" if key.revoked_at else "active"
        scopes = ",".join(sorted(key.scopes))
        print(f"{key.key_id:<14}{key.name[:23]:<24}{scopes:<20}{_when(key.created_at):<22}{status}")
    return 0


async def _revoke(args: argparse.Namespace) -> int:
    async with database(load_config(args.config)) as engine:
        try:
            key = await keys.revoke_key(engine, args.key_id)
        except HubError as exc:
            print(f"error: {exc.message}", file=sys.stderr)
            return 1
    print(f"revoked API key {key.describe()} at {_when(key.revoked_at)}")
    return 0


def _when(moment: datetime | None) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%SZ") if moment else "-"
