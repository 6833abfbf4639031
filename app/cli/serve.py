"""`atropos serve` (the HTTP API and the background stages) and `atropos worker` (the
stages alone)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from app import formats
from app.api.app import create_app
from app.api.server import exposure, listening_socket, server_config
from app.cli.options import Commands, add_hub_files, command, counted, load_settings
from app.config import Settings
from app.db.migrate import database, open_database
from app.evaluation.environment import Environment
from app.hub import entry_stage, hub_outages
from app.ingest.ingestor import running_ingest
from app.metrics import Tally, start_at_zero, summarizing
from app.tokens import encoding, tokenizer_class

log = logging.getLogger("atropos")


def register(commands: Commands[argparse.ArgumentParser]) -> None:
    serve = command(commands, "serve", _serve,
                    example="atropos serve --config config.json --compression "
                            "compression.json")
    add_hub_files(serve)
    serve.add_argument(
        "--no-workers", action="store_true", help="run the API alone (no background stages)"
    )
    worker = command(commands, "worker", _worker,
                     example="atropos worker --config config.json --burst")
    add_hub_files(worker)
    worker.add_argument("--burst", action="store_true", help="drain the work, then exit")


async def _serve(args: argparse.Namespace) -> int:
    workers = not args.no_workers
    settings = load_settings(args, delivers=workers)
    ts = settings.config.trace_server
    sock = listening_socket(ts)
    if warning := exposure(settings.config):
        log.warning(warning)
    # Rules first, then the database: a mistake costs no migration. The tokenizer is
    # only imported here; it loads once the server answers (see running_hub).
    environment = Environment.from_config(settings.config.environment)
    tokenizer_class()
    _metrics_at_zero(settings, environment)
    # Opened here so that a database it cannot reach stops start-up; the app's
    # lifespan owns it from then on.
    engine = await open_database(settings.config)
    answering = asyncio.Event()
    app = create_app(
        settings, environment=environment, engine=engine, workers=workers, answering=answering
    )
    server = _Server(
        server_config(app, ts, log_config=None, access_log=False, timeout_graceful_shutdown=30)
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if server.started:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        log.info("Trace server listening on %s:%s", host, port)
        answering.set()
    await serving
    if server.started:
        return 0
    # Stopped by a signal while it started (Ctrl-C: 130), or its start-up failed.
    return 128 + server.stopped_by if server.stopped_by else 1


class _Server(uvicorn.Server):
    """uvicorn, but a graceful stop on SIGTERM/SIGINT exits 0: uvicorn re-raises the
    signal after shutting down, which makes a clean stop look like a crash."""

    stopped_by = 0  # the signal that stopped it

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def _stop(self, sig: int) -> None:
        self.stopped_by = self.stopped_by or sig
        self.handle_exit(sig, None)


async def _worker(args: argparse.Namespace) -> int:
    # Not imported with `serve`, which builds its stages once it answers.
    from app.stages.pipeline import add_assembly, running_stages

    settings = load_settings(args, delivers=True)
    config = settings.config
    environment = Environment.from_config(config.environment)
    _metrics_at_zero(settings, environment)
    encoding()  # the compression stage counts tokens
    async with (
        database(config) as engine,
        running_stages(settings, engine, hub_outages(engine, settings)) as stages,
        # OTLP assembly prepares its trajectories as ingest does.
        running_ingest(engine, config, environment, admitted=False,
                       entry=entry_stage(settings)) as ingest,
    ):
        add_assembly(stages, engine, settings, ingest.ingestor)
        if args.burst:
            # The periodic summary would say nothing of a burst shorter than its interval.
            tally = Tally()
            advanced = await stages.drain()
            said = tally.said()
            log.info("burst done: %s advanced%s", counted(advanced, "item"),
                     f"; {said}" if said else "")
            return 0
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping.set)
        stages.start()
        log.info("Compression pipeline ready")
        async with summarizing(settings.config.trace_server.log_summary_seconds):
            await stopping.wait()
        log.info("stopping: leases of unfinished work expire for the next worker")
        return 0


def _metrics_at_zero(settings: Settings, environment: Environment) -> None:
    start_at_zero(formats=formats.FORMATS, filters=environment.filters.names,
                  strategy=settings.compression.compression.strategy,
                  target=settings.config.distributor.target)
