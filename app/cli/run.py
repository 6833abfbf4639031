"""`atropos run`: start a training run on a hub and follow it (app.runs.client)."""

from __future__ import annotations

import argparse

from app.cli.options import Commands, command
from app.runs import client


def register(commands: Commands[argparse.ArgumentParser]) -> None:
    run = command(
        commands,
        "run",
        client.main,
        config=None,  # it talks to a hub over HTTP
        example='atropos run --url http://127.0.0.1:8000 --trainer "python train.py" '
                '--env "python env.py"',
        description=client.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    client.add_arguments(run)
