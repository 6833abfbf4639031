"""`atropos db upgrade`: the database brought to the current schema, and nothing else
(every command that opens the database does as much first)."""

from __future__ import annotations

import argparse
import logging

from app.cli.options import Commands, command, group
from app.config import load_config
from app.db import migrate
from app.db.migrate import database

log = logging.getLogger("atropos")


def register(commands: Commands[argparse.ArgumentParser]) -> None:
    db_commands = group(commands, "db",
                        example="atropos db upgrade --config config.json")
    command(db_commands, "upgrade", _upgrade, help="bring the database to the current schema",
            example="atropos db upgrade --config config.json")


async def _upgrade(args: argparse.Namespace) -> int:
    async with database(load_config(args.config)) as engine:
        log.info("schema at revision %s", await migrate.current_revision(engine))
    return 0
