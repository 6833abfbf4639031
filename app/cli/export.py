"""`atropos export`: stored traces to a training file or dataset.

    --format openai|sharegpt|hermes|atif|native -o FILE   one record per line (JSONL)
    --format messages -o FILE.jsonl | -o DIR               records chat templates take
    --format parquet -o DIR                                a Hugging Face dataset
    --format dpo -o FILE.jsonl | -o DIR                    TRL preference pairs
    --format atropos -o FILE                               the hub's own Atropos groups

What is selected, by default, is what training would get: traces that are not
rejected and whose reward passes distributor.min_reward_threshold (for dpo, whose
pairs need the low runs too: every scored trace that is not rejected), leaving out the
traces a reviewer labelled `bad` (never batched, so never exported by default either).
`--all` lifts those defaults (`--label bad` asks for the bad ones); `--stage`,
`--min-reward` and `--since` narrow any selection. What is left out is printed by
reason, with counts: by the selection, by `--dedup` (identical content, the oldest
kept), by `--decontaminate FILE` (the task shares a word 13-gram with a line of FILE),
and traces the format cannot hold (no assistant turn).

Streamed: traces are read in pages of PAGE rows by keyset (created_at, trace_id), each
page written and dropped before the next is read, so memory stays flat whatever the
size of the database, and no transaction stays open for the whole export. Oldest
first. Every file is written privately (0600) under a temporary name in its own
directory, then renamed: a reader never sees half an export.
`--min-reward` reads `traces.reward`, which holds a reviewer's override where there is
one; `--label good` keeps the traces a reviewer labelled good.

`--format atropos` writes the groups the `atropos` target formed (app/atropos/hub_env.py),
one ScoredData JSON object per line, as GET /batch served them (env_id the hub's env's
when the group was queued): for a trainer that reads groups from a file. The trace
selection options do not apply.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import orjson
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app import files, formats
from app.atropos import hub_env
from app.atropos.tables import AtroposDb
from app.cli.options import Commands, add_since, command, counted
from app.cli.progress import Progress
from app.config import HubConfig, load_config
from app.db.migrate import database
from app.db.models import PAYLOADS, TRACES, WITH_PAYLOADS
from app.db.trace_queries import LabelFilter, labelled
from app.domain import Stage, Trace
from app.errors import ConfigError, StartupError, Unexportable
from app.evaluation.environment import Environment
from app.formats import dataset

log = logging.getLogger("atropos.export")

PAGE = 500
# Rejected traces are kept for inspection, not for training.
DEFAULT_STAGES = tuple(s.value for s in Stage if s not in (Stage.RECEIVED, Stage.REJECTED))
ALL_STAGES = tuple(s.value for s in Stage)
DATASETS = ("parquet", "dpo")
# Formats that write JSONL to FILE.jsonl or stdout, else a dataset directory.
EITHER = ("messages", "dpo")
GROUPS = "atropos"
FORMATS = (*formats.EXPORTS, *DATASETS, GROUPS)
SPLITS = ("train", "test")  # test: the eval split, as `datasets` names it


@dataclass(frozen=True)
class ExportQuery:
    """Which traces: stored filters (SQL), then per-trace ones (dedup, decontamination)."""

    fmt: str
    compressed: bool = False  # the compressed view where a trace has one
    min_reward: float | None = None
    since: datetime | None = None
    stages: tuple[str, ...] = DEFAULT_STAGES
    dedup: bool = False
    decontaminate: dataset.Contamination | None = None
    label: LabelFilter | None = None
    # A trace a reviewer labelled bad is never batched: training would not get it.
    without_bad: bool = True

    def clauses(self) -> list[sa.ColumnElement[bool]]:
        clauses = [*self.window(), TRACES.c.stage.in_(self.stages)]
        if self.without_bad:
            clauses.append(sa.not_(labelled("bad")))
        if self.min_reward is not None:
            clauses.append(TRACES.c.reward >= self.min_reward)
        if self.label is not None:
            clauses.append(labelled(self.label))
        return clauses

    def window(self) -> list[sa.ColumnElement[bool]]:
        """--since: the traces an export looks at, selected or left out."""
        return [] if self.since is None else [TRACES.c.created_at >= self.since]

    def reason(self) -> sa.ColumnElement[Any]:
        """Why a trace in the --since window is left out (NULL: it is selected)."""
        c = TRACES.c
        whens: list[tuple[sa.ColumnElement[bool], str]] = []
        for stage, why in ((Stage.REJECTED, "rejected"), (Stage.RECEIVED, "not scored yet")):
            if stage.value not in self.stages:
                whens.append((c.stage == stage.value, why))
        whens.append((c.stage.not_in(self.stages), "at a stage not asked for"))
        if self.without_bad:
            whens.append((labelled("bad"), "labelled bad"))
        if self.min_reward is not None:
            whens.append((sa.or_(c.reward.is_(None), c.reward < self.min_reward),
                          f"reward under {self.min_reward:g}"))
        if self.label is not None:
            whens.append((sa.not_(labelled(self.label)), f"not labelled {self.label}"))
        return sa.case(*whens, else_=sa.null())


@dataclass
class Exported:
    """What an export wrote (per split) and what it left out (per reason)."""

    written: Counter[str] = field(default_factory=Counter)
    left_out: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.written.values())

    def summary(self) -> str:
        if not self.left_out:
            return "left out: none"
        reasons = ", ".join(f"{n} {why}" for why, n in self.left_out.most_common())
        return f"left out {sum(self.left_out.values())}: {reasons}"


@dataclass(frozen=True)
class _Row:
    trace: Trace
    scores: dataset.Scores
    created_at: datetime


async def count(engine: AsyncEngine, query: ExportQuery) -> int:
    async with engine.connect() as conn:
        return int((await conn.scalar(sa.select(sa.func.count()).where(*query.clauses()))) or 0)


async def left_out_by_selection(engine: AsyncEngine, query: ExportQuery) -> Counter[str]:
    reason = query.reason().label("reason")
    select = sa.select(reason, sa.func.count()).where(*query.window()).group_by(reason)
    async with engine.connect() as conn:
        rows = (await conn.execute(select)).all()
    return Counter({why: n for why, n in rows if why is not None})


async def _pages(engine: AsyncEngine, query: ExportQuery) -> AsyncIterator[list[_Row]]:
    c = TRACES.c
    columns = [
        c.created_at, c.trace_id, _payload(query), c.reward, c.status, c.env,
        c.model, c.source_format, c.env_reward,
    ]
    after: tuple[Any, str] | None = None
    while True:
        page = sa.select(*columns).select_from(WITH_PAYLOADS).where(*query.clauses())
        if after is not None:
            page = page.where(sa.tuple_(c.created_at, c.trace_id) > after)
        async with engine.connect() as conn:
            rows = (await conn.execute(page.order_by(c.created_at, c.trace_id).limit(PAGE))).all()
        yield [
            _Row(
                Trace.model_validate(row.payload),
                dataset.Scores(row.trace_id, row.reward, row.env_reward, row.status,
                                       row.env, row.model, row.source_format),
                row.created_at,
            )
            for row in rows
        ]
        if len(rows) < PAGE:
            return
        after = (rows[-1].created_at, rows[-1].trace_id)


async def _selected(
    engine: AsyncEngine, query: ExportQuery, tally: Exported, progress: Progress | None
) -> AsyncIterator[_Row]:
    """The selected traces, oldest first, less duplicates and contaminated ones."""
    seen: set[str] = set()
    async for page in _pages(engine, query):
        for row in page:
            if query.dedup:
                key = dataset.content_key(row.trace)
                if key in seen:
                    tally.left_out["duplicate of an older trace"] += 1
                    continue
                seen.add(key)
            task = dataset.task_text(row.trace)
            if query.decontaminate is not None and query.decontaminate.touches(task):
                tally.left_out["task overlaps the --decontaminate set"] += 1
                continue
            yield row
        if progress is not None:
            progress.advance(len(page))


async def export_traces(
    engine: AsyncEngine, query: ExportQuery, out: IO[bytes], progress: Progress | None = None
) -> Exported:
    """Every selected trace as one JSON line in `query.fmt`."""
    tally = Exported()
    async for row in _selected(engine, query, tally, progress):
        try:
            record = formats.export(row.trace, query.fmt)
        except Unexportable as exc:
            tally.left_out[exc.message.split(":")[0]] += 1
            continue
        out.write(orjson.dumps(record) + b"\n")
        tally.written["train"] += 1
    return tally


async def export_parquet(
    engine: AsyncEngine, query: ExportQuery, directory: Path, eval_fraction: float,
    progress: Progress | None = None,
) -> Exported:
    """A `datasets`-ready directory: `train-*.parquet` (and, with an eval fraction,
    `test-*.parquet`), split by task so that runs of one task never sit in both.
    `parquet` holds OpenAI records with JSON text; `messages` its own records, whose
    arguments and tool schemas `datasets` decodes into objects."""
    tally = Exported()
    sft = dataset.SFT[query.fmt]
    with _ParquetSplits(directory, sft.schema()) as splits:
        rows: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
        async for row in _selected(engine, query, tally, progress):
            try:
                record = formats.export(row.trace, sft.record)
            except Unexportable as exc:
                tally.left_out[exc.message.split(":")[0]] += 1
                continue
            split = dataset.split_of(dataset.task_key(row.trace), eval_fraction)
            rows[split].append(sft.row(record, row.scores))
            tally.written[split] += 1
            if len(rows[split]) >= PAGE:
                splits.write(split, rows[split])
                rows[split] = []
        for split, left in rows.items():
            splits.write(split, left)
    return tally


async def export_dpo(
    engine: AsyncEngine, query: ExportQuery, output: str, *, margin: float,
    max_pairs_per_run: int, eval_fraction: float, progress: Progress | None = None,
    across_agents: bool = False,
) -> Exported:
    """Preference pairs of runs of one task (rewards `margin` apart); JSONL to a
    `.jsonl` file or stdout, else a parquet directory like `export_parquet`'s."""
    tally = Exported()
    runs: list[dataset.Attempt] = []
    async for row in _selected(engine, query, tally, progress):
        if row.scores.reward is None:
            tally.left_out["no reward"] += 1
            continue
        if not dataset.pairable(row.trace):
            tally.left_out["no task (an empty prompt is never paired)"] += 1
            continue
        runs.append(dataset.pairing_attempt(row.scores.trace_id, row.trace, row.scores.reward))
    pairs = dataset.preference_pairs(runs, margin, max_pairs_per_run,
                                     across_agents=across_agents)
    paired = {r.trace_id for pair in pairs for r in pair}
    tally.left_out["in no pair"] += len(runs) - len(paired)
    traces = await _load(engine, query, paired)
    records = []
    for chosen, rejected in pairs:
        try:
            record = dataset.dpo_record(traces[chosen.trace_id], traces[rejected.trace_id])
        except Unexportable as exc:
            reason = exc.message.split(":")[0]
            tally.left_out[f"pairs with a run the format cannot hold ({reason})"] += 1
            continue
        records.append((dataset.split_of(chosen.task, eval_fraction), record, chosen, rejected))
    if output == "-" or output.endswith(".jsonl"):
        with _output(output) as out:
            for _, record, chosen, rejected in records:
                line = {**record, **dataset.pair_scores(chosen, rejected)}
                out.write(orjson.dumps(line) + b"\n")
                tally.written["train"] += 1
        return tally
    with _ParquetSplits(Path(output), dataset.dpo_schema()) as splits:
        for split in SPLITS:
            chunk = [dataset.dpo_row(r, chosen, rejected)
                     for s, r, chosen, rejected in records if s == split]
            splits.write(split, chunk)
            tally.written[split] += len(chunk)
    return tally


def _payload(query: ExportQuery) -> sa.ColumnElement[Any]:
    """The trace exported: the compressed one where there is one, if asked for."""
    p = PAYLOADS.c
    return (sa.func.coalesce(p.compressed, p.trace) if query.compressed else p.trace).label(
        "payload")


async def _load(engine: AsyncEngine, query: ExportQuery, trace_ids: set[str]) -> dict[str, Trace]:
    c = TRACES.c
    found: dict[str, Trace] = {}
    wanted = sorted(trace_ids)
    for start in range(0, len(wanted), PAGE):
        select = sa.select(c.trace_id, _payload(query)).select_from(WITH_PAYLOADS).where(
            c.trace_id.in_(wanted[start : start + PAGE]))
        async with engine.connect() as conn:
            for row in await conn.execute(select):
                found[row.trace_id] = Trace.model_validate(row.payload)
    return found


# --- files ---------------------------------------------------------------------------


@contextlib.contextmanager
def _output(target: str) -> Iterator[IO[bytes]]:
    if target == "-":
        yield sys.stdout.buffer
    else:
        with files.replaced(Path(target)) as f:
            yield f


class _ParquetSplits:
    """One parquet file per split in a directory, each written under a private
    temporary name and renamed when complete; split files of an earlier export that
    this one does not write are removed, so the directory holds this export only."""

    def __init__(self, directory: Path, schema: Any):
        import pyarrow.parquet as pq

        self._pq = pq
        self._dir = directory
        self._schema = schema
        # Rows are built on the schema's storage types (JSON columns as text), then
        # cast: pyarrow builds no extension type from Python values.
        self._storage = dataset.storage_schema(schema)
        self._writers: dict[str, tuple[Any, contextlib.ExitStack]] = {}

    def __enter__(self) -> _ParquetSplits:
        files.make_dir(self._dir)
        return self

    def write(self, split: str, rows: list[dict[str, Any]]) -> None:
        if not rows and (split != "train" or split in self._writers):
            return  # an empty train split is still written: the dataset has its columns
        if split not in self._writers:
            stack = contextlib.ExitStack()
            f = stack.enter_context(files.replaced(self._dir / _split_file(split)))
            self._writers[split] = (self._pq.ParquetWriter(f, self._schema), stack)
        import pyarrow as pa

        table = pa.Table.from_pylist(rows, schema=self._storage).cast(self._schema)
        self._writers[split][0].write_table(table)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for writer, stack in self._writers.values():
            writer.close()
            stack.__exit__(kind, error, tb)  # renamed into place, or removed on error
        if error is None:
            keep = {_split_file(s) for s in self._writers}
            for old in self._dir.glob("*.parquet"):
                if old.name.split("-")[0] in SPLITS and old.name not in keep:
                    old.unlink()


def _split_file(split: str) -> str:
    return f"{split}-00000-of-00001.parquet"


_COLUMNS = {
    "parquet": "Tool calls (`tool_calls` of a message) and tool schemas (`tools`) are JSON "
               "text: `json.loads` restores them.",
    "messages": "Each tool call's `arguments` and each tool schema (`tools`) are JSON "
                "columns (`datasets.Json`): they load as objects, ready for "
                "`tokenizer.apply_chat_template(row[\"messages\"], tools=row[\"tools\"])`.",
}


def _card(directory: Path, args: argparse.Namespace, query: ExportQuery, tally: Exported,
          fingerprint: str) -> None:
    """README.md: the dataset card, saying what is in the directory and how it was made."""
    now = datetime.now(UTC).isoformat(timespec="seconds")
    splits = [s for s in SPLITS if tally.written[s] or s == "train"]
    front = ["---", "configs:", "- config_name: default", "  data_files:"]
    front += [f"  - split: {s}\n    path: {_split_file(s)}" for s in splits]
    lines = [
        *front, "---", "", "# atropos-hub export", "",
        f"Exported {now} by `atropos export --format {query.fmt}`. Load it with "
        f"`datasets.load_dataset(\"parquet\", data_dir=\"{directory.name}\")`.", "",
        "| split | rows |", "|---|---|",
        *(f"| {s} | {tally.written[s]} |" for s in splits), "",
        "## Selection", "",
        f"- stages: {', '.join(query.stages)}",
        f"- reward >= {query.min_reward:g}" if query.min_reward is not None else "- any reward",
        f"- created since {query.since.isoformat()}" if query.since else "- any date",
        f"- view: {'compressed where compressed' if query.compressed else 'original'}",
        f"- duplicates removed: {'yes' if query.dedup else 'no'}",
        f"- decontaminated against: {args.decontaminate or 'nothing'}",
        f"- eval split (`test`): {args.eval_fraction:g} of the tasks, by the task's hash",
    ]
    if query.fmt == "dpo":
        lines.append(f"- pairs: reward margin >= {args.margin:g}, "
                     f"at most {args.max_pairs_per_run} pairs per run")
    lines += ["", "## Left out", ""]
    lines += [f"- {n} {why}" for why, n in tally.left_out.most_common()] or ["- none"]
    lines += [
        "", "## Scoring", "",
        f"Reward rules fingerprint: `{fingerprint}` (the `environment` section of "
        "config.json; `atropos rescore` re-scores stored traces when it changes).", "",
        "## Columns", "", _COLUMNS.get(query.fmt, _COLUMNS["parquet"]) + " `env_reward` is "
        "the environment's own reward (null when it sent none).", "",
    ]
    with files.replaced(directory / "README.md") as f:
        f.write("\n".join(lines).encode())


# --- the command ---------------------------------------------------------------------


def register(commands: Commands[argparse.ArgumentParser]) -> None:
    parser = command(commands, "export", run,
                     example="atropos export --config config.json --format openai "
                             "-o train.jsonl")
    parser.add_argument("--format", required=True, choices=sorted(FORMATS))
    parser.add_argument("--compressed", action="store_true",
                        help="the compressed view of each trace that has one")
    parser.add_argument("--min-reward", type=float, help="only traces with reward >= R")
    add_since(parser)
    parser.add_argument("--stage", action="append", choices=[s.value for s in Stage],
                        help="only traces at this stage (repeatable; default: all but rejected)")
    parser.add_argument("-o", "--output", required=True,
                        help="the file to write ('-': stdout), or the dataset directory")
    parser.add_argument("--all", action="store_true",
                        help="every trace: rejected, under the threshold and labelled bad too")
    parser.add_argument("--dedup", action="store_true",
                        help="leave out traces whose content equals an older one's")
    parser.add_argument("--decontaminate", type=Path, metavar="FILE",
                        help="leave out traces whose task shares a 13-gram with a line of FILE")
    parser.add_argument("--eval-fraction", type=_fraction, default=0.0, metavar="F",
                        help="parquet: put this fraction of the tasks in an eval split")
    parser.add_argument("--margin", type=_positive, default=1.0,
                        help="dpo: the least reward difference of a pair (default 1)")
    parser.add_argument("--max-pairs-per-run", type=int, default=1, metavar="N",
                        help="dpo: pairs a run may be in (default 1)")
    parser.add_argument("--across-agents", action="store_true",
                        help="dpo: pair runs of one task by different agents too")
    parser.add_argument("--label", choices=["good", "bad", "unreviewed"],
                        help="only traces a reviewer labelled so (unreviewed: none did)")


async def run(args: argparse.Namespace) -> int:
    """The command: select, write, and say what was left out and why."""
    config = load_config(args.config)
    query = _query(args, config.distributor.min_reward_threshold)
    if args.format == "parquet" and args.output == "-":
        raise ConfigError("--format parquet writes a dataset directory: -o DIR, not -")
    if args.eval_fraction and not _to_directory(args):
        raise ConfigError("--eval-fraction needs a dataset directory: --format parquet, "
                          "or --format messages or dpo with -o DIR")
    if args.max_pairs_per_run < 1:
        raise ConfigError("--max-pairs-per-run must be at least 1")
    if not _to_directory(args) and args.output != "-" \
            and not Path(args.output).parent.is_dir():
        raise StartupError(
            f"-o {args.output}: the directory {Path(args.output).parent} does not exist; "
            "create it first or write elsewhere"
        )
    if args.format == GROUPS:
        return await _export_groups(config, args.output)
    async with database(config) as engine:
        left_out = await left_out_by_selection(engine, query)
        progress = Progress("exported", await count(engine, query))
        tally = await _write(engine, query, args, progress)
        progress.close()
    tally.left_out.update(left_out)
    if _to_directory(args):
        _card(Path(args.output), args, query,
              tally, Environment.from_config(config.environment).fingerprint)
    what = counted(tally.total, "pair" if args.format == "dpo" else "trace")
    splits = ", ".join(f"{tally.written[s]} {s}" for s in SPLITS)
    print(f"exported {what} as {args.format} to {args.output}"
          + (f" ({splits})" if tally.written["test"] else ""), file=sys.stderr)
    print(tally.summary(), file=sys.stderr)
    return 0


async def _export_groups(config: HubConfig, output: str) -> int:
    written = 0
    try:
        async with database(config) as engine:
            db = AtroposDb(engine)
            try:
                with _output(output) as out:
                    after: str | None = None
                    while page := await db.read(
                            partial(hub_env.formed_groups, after=after, limit=PAGE)):
                        out.write(b"".join(orjson.dumps(g) + b"\n" for g in page))
                        written += len(page)
                        after = page[-1]["group_overrides"]["hub_group"]
            finally:
                await db.close()
    except OSError as exc:
        raise StartupError(f"-o {output}: cannot write ({exc.strerror or exc}): "
                           "check the directory is writable and has space") from exc
    print(f"exported {counted(written, 'group')} as atropos to {output}", file=sys.stderr)
    return 0


async def _write(engine: AsyncEngine, query: ExportQuery, args: argparse.Namespace,
                 progress: Progress) -> Exported:
    try:
        return await _write_format(engine, query, args, progress)
    except OSError as exc:
        raise StartupError(
            f"-o {args.output}: cannot write ({exc.strerror or exc}): "
            "check the directory is writable and has space"
        ) from exc


async def _write_format(engine: AsyncEngine, query: ExportQuery, args: argparse.Namespace,
                        progress: Progress) -> Exported:
    if args.format == "parquet" or (args.format == "messages" and _to_directory(args)):
        return await export_parquet(engine, query, Path(args.output), args.eval_fraction, progress)
    if args.format == "dpo":
        return await export_dpo(engine, query, args.output, margin=args.margin,
                                max_pairs_per_run=args.max_pairs_per_run,
                                eval_fraction=args.eval_fraction, progress=progress,
                                across_agents=args.across_agents)
    with _output(args.output) as out:
        return await export_traces(engine, query, out, progress)


def _query(args: argparse.Namespace, threshold: float) -> ExportQuery:
    stages = DEFAULT_STAGES
    min_reward: float | None = threshold
    if args.format == "dpo":
        min_reward = None  # a pair needs its low run: the margin selects
    if args.all:
        stages, min_reward = ALL_STAGES, None
    query = ExportQuery(args.format, args.compressed, min_reward, args.since, stages,
                        dedup=args.dedup, label=args.label,
                        without_bad=not (args.all or args.label == "bad"))
    if args.stage:
        query = replace(query, stages=tuple(args.stage))
    if args.min_reward is not None:
        query = replace(query, min_reward=args.min_reward)
    if args.decontaminate is not None:
        query = replace(query, decontaminate=_contamination(args.decontaminate))
    return query


def _contamination(path: Path) -> dataset.Contamination:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            found = dataset.Contamination(f)
    except OSError as exc:
        raise ConfigError(f"--decontaminate: cannot read {path}: {exc.strerror or exc}") from None
    if not len(found):
        log.warning("--decontaminate %s: no line has 13 words; nothing can match", path)
    return found


def _to_directory(args: argparse.Namespace) -> bool:
    return args.format == "parquet" or (
        args.format in EITHER and args.output != "-" and not args.output.endswith(".jsonl")
    )


def _fraction(value: str) -> float:
    number = float(value)
    if not 0 <= number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and under 1, not {value}")
    return number


def _positive(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {value}")
    return number
