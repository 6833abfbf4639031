"""The `atropos` command: a thin layer that loads the config files once and hands
them to the hub. Every command that opens the database migrates it first."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import uvicorn

from app import formats, import_sources
from app.access import keys
from app.api.app import create_app
from app.api.server import server_config
from app.cli import importer, rescore
from app.cli.doctor import diagnose
from app.cli.export import DEFAULT_STAGES, ExportQuery, count, export_traces
from app.cli.progress import Progress
from app.config import load_compression, load_config, load_tinker
from app.db import migrate
from app.db.batch_queries import retry_batch
from app.domain import Stage
from app.durations import parse_duration
from app.errors import ConfigError, HubError, StartupError
from app.evaluation.environment import Environment
from app.hub import Settings, open_database, running_stages
from app.ingest.ingestor import Ingestor
from app.ingest.inserter import TraceInserter
from app.ingest.tokens import encoding
from app.llm import LLMError
from app.runs import client as run_client
from app.stages import retention
from app.training import TrainingFailed
from app.training.dataset import train_dataset

log = logging.getLogger("atropos")


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    _setup_logging()
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            code = runner.run(args.run(args))
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where it is installed (it comes with uvicorn[standard]): the HTTP path
    spends a good part of its time in the event loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atropos", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the HTTP API and the background stages")
    _config_args(serve)
    serve.add_argument(
        "--no-workers", action="store_true", help="run the API alone (no background stages)"
    )
    serve.set_defaults(run=_serve)

    worker = commands.add_parser("worker", help="run the background stages only")
    _config_args(worker)
    worker.add_argument("--burst", action="store_true", help="drain the work, then exit")
    worker.set_defaults(run=_worker)

    imp = commands.add_parser("import", help="store trajectory files through the pipeline")
    imp.add_argument("--config", required=True, help="config.json")
    imp.add_argument("paths", nargs="+", type=Path, help="files or folders of trajectories")
    imp.add_argument("--format", default="auto", help="an adapter name, or auto (default)")
    imp.add_argument("--url", help="POST to this running hub instead of the database")
    imp.add_argument(
        "--api-key-env",
        default="ATROPOS_API_KEY",
        help="with --url: the environment variable holding the hub's API key "
        "(default ATROPOS_API_KEY; unset: none is sent)",
    )
    imp.add_argument("--strict", action="store_true", help="an unreadable record fails the run")
    imp.set_defaults(run=_import)

    rescore = commands.add_parser("rescore", help="score stored traces with the current rules")
    rescore.add_argument("--config", required=True, help="config.json")
    rescore.add_argument("--since", type=_datetime,
                         help="only traces created since: an ISO date/time or an age (7d, 12h)")
    rescore.set_defaults(run=_rescore)

    train = commands.add_parser("train", help="one training job from a dataset file")
    train.add_argument("--config", required=True, help="tinker.json")
    train.add_argument("--dataset", required=True, type=Path, help="a JSONL training file")
    train.add_argument("--output", required=True, type=Path,
                       help="where the job record, the log and the hyperparameters go")
    train.set_defaults(run=_train)

    export = commands.add_parser("export", help="stored traces to a JSONL training file")
    export.add_argument("--config", required=True, help="config.json")
    export.add_argument("--format", required=True, choices=sorted(formats.EXPORTS))
    export.add_argument("--compressed", action="store_true",
                        help="the compressed view of each trace that has one")
    export.add_argument("--min-reward", type=float, help="only traces with reward >= R")
    export.add_argument("--since", type=_datetime,
                        help="only traces created since: an ISO date/time or an age (7d, 12h)")
    export.add_argument("--stage", action="append", choices=[s.value for s in Stage],
                        help="only traces at this stage (repeatable; default: all but rejected)")
    export.add_argument("-o", "--output", required=True, help="the file to write ('-': stdout)")
    export.set_defaults(run=_export)

    doctor = commands.add_parser("doctor", help="check the model endpoint set-up")
    doctor.add_argument("--tinker", required=True, help="tinker.json")
    doctor.set_defaults(run=_doctor)

    batches = commands.add_parser("batches", help="training batches")
    batch_commands = batches.add_subparsers(dest="batches_command", required=True)
    retry = batch_commands.add_parser("retry", help="re-queue a failed batch")
    retry.add_argument("batch_id")
    retry.add_argument("--config", required=True, help="config.json")
    retry.set_defaults(run=_batches_retry)

    prune = commands.add_parser(
        "prune", help="delete old traces (never one still on its way to training)"
    )
    prune.add_argument("--config", required=True, help="config.json")
    prune.add_argument(
        "--older-than", required=True, type=_duration, help="e.g. 30d, 12h, 2w (created before)"
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
    prune.add_argument("--batch-size", type=int, default=1000, help="traces per transaction")
    prune.add_argument(
        "--no-vacuum", action="store_true", help="SQLite: skip VACUUM (it locks writers out)"
    )
    prune.set_defaults(run=_prune)

    key_cmd = commands.add_parser("keys", help="API keys (auth.enabled)")
    key_commands = key_cmd.add_subparsers(dest="keys_command", required=True)
    create = key_commands.add_parser("create", help="make a key; prints it once, last line")
    create.add_argument("--config", required=True, help="config.json")
    create.add_argument(
        "--scope",
        action="append",
        required=True,
        choices=[s.value for s in keys.Scope],
        help="ingest, read or admin (admin includes both; repeatable)",
    )
    create.add_argument("--name", required=True, help="who or what the key is for")
    create.set_defaults(run=_keys_create)
    listing = key_commands.add_parser("list", help="every key, revoked ones too")
    listing.add_argument("--config", required=True, help="config.json")
    listing.set_defaults(run=_keys_list)
    revoke = key_commands.add_parser("revoke", help="stops the key (within auth.key_cache_seconds)")
    revoke.add_argument("--config", required=True, help="config.json")
    revoke.add_argument("key_id", help="the id shown by `atropos keys list`")
    revoke.set_defaults(run=_keys_revoke)

    run = commands.add_parser(
        "run",
        help="start a training run on a hub and follow it",
        description=run_client.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run_client.add_arguments(run)
    run.set_defaults(run=run_client.main)

    db = commands.add_parser("db", help="database operations")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    upgrade = db_commands.add_parser("upgrade", help="bring the database to the current schema")
    upgrade.add_argument("--config", required=True, help="config.json")
    upgrade.set_defaults(run=_db_upgrade)
    return parser


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="config.json")
    parser.add_argument("--compression", help="compression.json")
    parser.add_argument("--tinker", help="tinker.json (model and training endpoint)")


def _setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    # Alembic narrates every migration step; our own line says which revision we reach.
    logging.getLogger("alembic").setLevel(logging.WARNING)


def _settings(args: argparse.Namespace) -> Settings:
    return Settings(
        load_config(args.config), load_compression(args.compression), load_tinker(args.tinker)
    )


async def _serve(args: argparse.Namespace) -> int:
    settings = _settings(args)
    workers = not args.no_workers
    # Rules and tokenizer first, then the database: a mistake costs no migration.
    environment = Environment.from_config(settings.config.environment)
    encoding()
    engine = await open_database(settings.config)
    app = create_app(settings, environment=environment, engine=engine, workers=workers)
    ts = settings.config.trace_server
    server = _Server(
        server_config(app, ts, log_config=None, access_log=False, timeout_graceful_shutdown=30)
    )
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if server.started:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        log.info("Trace server listening on %s:%s", host, port)
        if workers:
            log.info("Compression pipeline ready")
    await serving
    return 0 if server.started else 1


class _Server(uvicorn.Server):
    """uvicorn, but a graceful stop on SIGTERM/SIGINT exits 0: uvicorn re-raises the
    signal after shutting down, which makes a clean stop look like a crash."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


async def _worker(args: argparse.Namespace) -> int:
    settings = _settings(args)
    encoding()  # the compression stage counts tokens
    engine = await open_database(settings.config)
    try:
        async with running_stages(settings, engine) as stages:
            if args.burst:
                advanced = await stages.drain()
                log.info("burst done: %d items advanced", advanced)
                return 0
            stopping = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stopping.set)
            stages.start()
            log.info("Compression pipeline ready")
            await stopping.wait()
            log.info("stopping: leases of unfinished work expire for the next worker")
            return 0
    finally:
        await engine.dispose()


async def _train(args: argparse.Namespace) -> int:
    tinker = load_tinker(args.config).tinker
    try:
        record = await train_dataset(tinker, args.dataset, args.output)
    except (LLMError, TrainingFailed) as exc:
        print(f"error: training failed: {exc} (details in {args.output})", file=sys.stderr)
        return 1
    job = record["receipt"]["job"]
    print(f"job {job['id']} {job['state']}: fine-tuned model {job['model']} "
          f"(record in {args.output / 'job.json'})")
    return 0


async def _export(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    query = ExportQuery(args.format, args.compressed, args.min_reward, args.since,
                        tuple(args.stage) if args.stage else DEFAULT_STAGES)
    engine = await open_database(config)
    try:
        progress = Progress("exported", await count(engine, query))
        if args.output == "-":
            written = await export_traces(engine, query, sys.stdout.buffer, progress)
        else:
            # Written beside the target and renamed: a reader never sees half an export.
            out = Path(args.output)
            tmp = out.with_name(f".{out.name}.tmp")
            with open(tmp, "wb") as f:
                written = await export_traces(engine, query, f, progress)
            os.replace(tmp, out)
        progress.close()
    finally:
        await engine.dispose()
    log.info("exported %d traces as %s to %s", written, args.format, args.output)
    return 0


async def _doctor(args: argparse.Namespace) -> int:
    return await diagnose(load_tinker(args.tinker).tinker, sys.stdout)


async def _batches_retry(args: argparse.Namespace) -> int:
    engine = await open_database(load_config(args.config))
    try:
        batch = await retry_batch(engine, args.batch_id)
    except HubError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    finally:
        await engine.dispose()
    print(f"batch {batch['batch_id']} is pending again (last error: {batch['last_error']})")
    return 0


async def _import(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if args.format != "auto" and args.format not in import_sources.formats():
        known = ", ".join(import_sources.formats())
        raise ConfigError(f"--format {args.format}: unknown; one of auto, {known}")
    summary = importer.Summary()
    progress = Progress("imported")
    batches = importer.chunks(importer.records(args.paths, args.format))
    if args.url:
        headers = keys.bearer_from_env(args.api_key_env)
        async with httpx.AsyncClient(base_url=args.url, timeout=120, headers=headers) as client:
            for chunk in batches:
                await importer.import_over_http(
                    client, config.trace_server.endpoint, chunk, summary
                )
                progress.advance(len(chunk))
    else:
        encoding()
        engine = await open_database(config)
        inserter = TraceInserter(engine)
        ingestor = Ingestor(
            inserter,
            Environment.from_config(config.environment),
            config.limits,
            processes=config.trace_server.ingest_processes,
        )
        inserter.start()
        ingestor.start()
        try:
            for chunk in batches:
                await importer.import_into_database(ingestor, chunk, summary)
                progress.advance(len(chunk))
        finally:
            await inserter.stop()
            await ingestor.close()
            await engine.dispose()
    progress.close()
    for line in summary.lines():
        print(line)
    failed = summary.refused or (args.strict and summary.unreadable)
    return 1 if failed else 0


async def _rescore(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    environment = Environment.from_config(config.environment)
    engine = await open_database(config)
    try:
        progress = Progress("rescored", await rescore.pending(engine, environment, args.since))
        counts = await rescore.rescore(
            engine, environment, since=args.since, on_batch=progress.advance
        )
        progress.close()
    finally:
        await engine.dispose()
    print(f"rescored: {counts.pop('rescored', 0)}")
    for move, n in sorted(counts.items()):
        print(f"stage {move}: {n}")
    return 0


def _datetime(value: str) -> datetime:
    """An ISO 8601 date or time (UTC unless it says otherwise), or an age: 30m, 12h, 7d."""
    try:
        return datetime.now(UTC) - parse_duration(value)
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an ISO 8601 date or time, nor an age like 7d: {value!r}"
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _duration(value: str) -> timedelta:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _prunable_stage(value: str) -> Stage:
    try:
        stage = Stage(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown stage {value!r}; one of {', '.join(Stage)}"
        ) from None
    if stage is Stage.BATCHED:
        raise argparse.ArgumentTypeError("batched traces wait for delivery; never pruned")
    return stage


async def _prune(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise ConfigError("--batch-size: must be at least 1")
    config = load_config(args.config)
    criteria = retention.Criteria(args.older_than, args.max_reward, tuple(args.stage))
    engine = await open_database(config)
    try:
        result = await retention.prune(
            engine,
            criteria,
            batch_size=args.batch_size,
            dry_run=args.dry_run,
            vacuum=not args.no_vacuum,
        )
    finally:
        await engine.dispose()
    print(f"matching: {result.matched} traces {criteria.describe()}")
    if args.dry_run:
        print("dry run: nothing deleted")
        return 0
    print(f"deleted: {result.deleted} in {result.batches} batches")
    if result.maintenance:
        print(f"then: {', '.join(result.maintenance)}")
    return 0


async def _keys_create(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if not config.auth.enabled:
        log.warning("auth.enabled is false in %s: keys are not checked until it is true",
                    args.config)
    engine = await open_database(config)
    try:
        key, secret = await keys.create_key(engine, args.name, {keys.Scope(s) for s in args.scope})
    finally:
        await engine.dispose()
    print(f"created API key {key.describe()}, scopes: {', '.join(sorted(key.scopes))}")
    print("it is shown only now; the hub keeps a hash of it:")
    print(secret)
    return 0


async def _keys_list(args: argparse.Namespace) -> int:
    engine = await open_database(load_config(args.config))
    try:
        found = await keys.list_keys(engine)
    finally:
        await engine.dispose()
    print(f"{'KEY_ID':<14}{'NAME':<24}{'SCOPES':<20}{'CREATED':<22}STATUS")
    for key in found:
        status = f"revoked {_when(key.revoked_at)}" if key.revoked_at else "active"
        scopes = ",".join(sorted(key.scopes))
        print(f"{key.key_id:<14}{key.name[:23]:<24}{scopes:<20}{_when(key.created_at):<22}{status}")
    return 0


async def _keys_revoke(args: argparse.Namespace) -> int:
    engine = await open_database(load_config(args.config))
    try:
        key = await keys.revoke_key(engine, args.key_id)
    except HubError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    finally:
        await engine.dispose()
    print(f"revoked API key {key.describe()} at {_when(key.revoked_at)}")
    return 0


def _when(moment: datetime | None) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%SZ") if moment else "-"


async def _db_upgrade(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    engine = await open_database(config)
    log.info("schema at revision %s", await migrate.current_revision(engine))
    await engine.dispose()
    return 0

