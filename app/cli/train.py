"""`atropos train`: one training job from a dataset file (app.training.dataset)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from app.cli.options import Commands, command
from app.config import load_tinker
from app.errors import ServiceError
from app.training.dataset import train_dataset


def register(commands: Commands[argparse.ArgumentParser]) -> None:
    train = command(commands, "train", _train, config="tinker.json",
                    example="atropos train --config tinker.json --dataset train.jsonl "
                            "--output runs/first")
    train.add_argument("--dataset", required=True, type=Path, help="a JSONL training file")
    train.add_argument("--output", required=True, type=Path,
                       help="where the job record, the log and the hyperparameters go")


async def _train(args: argparse.Namespace) -> int:
    tinker = load_tinker(args.config).tinker
    try:
        record = await train_dataset(tinker, args.dataset, args.output)
    except ServiceError as exc:
        print(f"error: training failed: {exc} (details in {args.output})", file=sys.stderr)
        return 1
    job = record["receipt"]["job"]
    print(f"job {job['id']} {job['state']}: fine-tuned model {job['model']} "
          f"(record in {args.output / 'job.json'})")
    return 0
