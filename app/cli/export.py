"""`atropos export`: stored traces to a training file, one record per line (JSONL) in
any export format.

Streamed: traces are read in pages of PAGE rows by keyset (created_at, trace_id), each
page written and dropped before the next is read, so memory stays flat whatever the
size of the database, and no transaction stays open for the whole export. Oldest first.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import orjson
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app import formats
from app.cli.options import Commands, add_since, command
from app.cli.progress import Progress
from app.config import load_config
from app.db.models import TRACES
from app.domain import Stage, Trace
from app.errors import StartupError
from app.hub import database

log = logging.getLogger("atropos")

PAGE = 500
# Rejected traces are kept for inspection, not for training.
DEFAULT_STAGES = tuple(s.value for s in Stage if s not in (Stage.RECEIVED, Stage.REJECTED))


@dataclass(frozen=True)
class ExportQuery:
    fmt: str
    compressed: bool = False  # the compressed view where a trace has one
    min_reward: float | None = None
    since: datetime | None = None
    stages: tuple[str, ...] = DEFAULT_STAGES

    def clauses(self) -> list[sa.ColumnElement[bool]]:
        c = TRACES.c
        clauses: list[sa.ColumnElement[bool]] = [c.stage.in_(self.stages)]
        if self.min_reward is not None:
            clauses.append(c.reward >= self.min_reward)
        if self.since is not None:
            clauses.append(c.created_at >= self.since)
        return clauses


async def count(engine: AsyncEngine, query: ExportQuery) -> int:
    async with engine.connect() as conn:
        return int((await conn.scalar(sa.select(sa.func.count()).where(*query.clauses()))) or 0)


async def export_traces(
    engine: AsyncEngine, query: ExportQuery, out: IO[bytes], progress: Progress | None = None
) -> int:
    """Write every matching trace to `out` as one JSON line in `query.fmt`; returns how many."""
    c = TRACES.c
    payload = sa.func.coalesce(c.compressed, c.trace) if query.compressed else c.trace
    written = 0
    after: tuple[Any, str] | None = None
    while True:
        page = sa.select(c.created_at, c.trace_id, payload.label("payload")).where(*query.clauses())
        if after is not None:
            page = page.where(sa.tuple_(c.created_at, c.trace_id) > after)
        async with engine.connect() as conn:
            rows = (await conn.execute(page.order_by(c.created_at, c.trace_id).limit(PAGE))).all()
        for row in rows:
            record = formats.export(Trace.model_validate(row.payload), query.fmt)
            out.write(orjson.dumps(record) + b"\n")
        written += len(rows)
        if progress is not None:
            progress.advance(len(rows))
        if len(rows) < PAGE:
            return written
        after = (rows[-1].created_at, rows[-1].trace_id)


# --- the command ----------------------------------------------------------------


def register(commands: Commands[argparse.ArgumentParser]) -> None:
    export = command(commands, "export", _export, help="stored traces to a JSONL training file")
    export.add_argument("--format", required=True, choices=sorted(formats.EXPORTS))
    export.add_argument("--compressed", action="store_true",
                        help="the compressed view of each trace that has one")
    export.add_argument("--min-reward", type=float, help="only traces with reward >= R")
    add_since(export)
    export.add_argument("--stage", action="append", choices=[s.value for s in Stage],
                        help="only traces at this stage (repeatable; default: all but rejected)")
    export.add_argument("-o", "--output", required=True, help="the file to write ('-': stdout)")


async def _export(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if args.output != "-" and not Path(args.output).parent.is_dir():
        raise StartupError(
            f"-o {args.output}: the directory {Path(args.output).parent} does not exist; "
            "create it first or write elsewhere"
        )
    query = ExportQuery(args.format, args.compressed, args.min_reward, args.since,
                        tuple(args.stage) if args.stage else DEFAULT_STAGES)
    async with database(config) as engine:
        progress = Progress("exported", await count(engine, query))
        if args.output == "-":
            written = await export_traces(engine, query, sys.stdout.buffer, progress)
        else:
            # Written beside the target and renamed: a reader never sees half an export.
            out = Path(args.output)
            tmp = out.with_name(f".{out.name}.tmp")
            try:
                with open(tmp, "wb") as f:
                    written = await export_traces(engine, query, f, progress)
                os.replace(tmp, out)
            except OSError as exc:
                raise StartupError(
                    f"-o {args.output}: cannot write ({exc.strerror}): "
                    "check the directory is writable and has space"
                ) from exc
            finally:
                tmp.unlink(missing_ok=True)  # nothing half-written is left behind
        progress.close()
    log.info("exported %d traces as %s to %s", written, args.format, args.output)
    return 0
