"""Pipeline benchmark: N concurrent HTTP clients post native traces to a real
`atropos serve` with every stage running (compression, distribution, delivery to the
jsonl target) for a fixed time; then it waits for the pipeline to drain and reports,
from the database, the ingest rate, the end-to-end delivered traces/s, and the lag from
ingest (created_at) to delivery (the batch's delivered_at) per trace.

The stages keep up when the delivery rate matches the ingest rate and the lag stays
bounded: its p99 should be under 2 x flush_interval_seconds.

    python bench/pipeline.py                          # 5 KB traces, 32 clients, 10 s
    python bench/pipeline.py --trace-kb 20 --seconds 20 --flush-interval 5
    python bench/pipeline.py --db postgresql --database-url postgresql://user@127.0.0.1/db
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402
from sqlalchemy.ext.asyncio import AsyncConnection  # noqa: E402

from app.config import TraceServerConfig  # noqa: E402
from app.db.engine import create_engine  # noqa: E402
from app.db.models import BATCHES, MEMBERS, TRACES  # noqa: E402
from app.domain import ELIGIBLE  # noqa: E402
from bench.ingest import load, load_arguments, trace_server  # noqa: E402


def start(command: str, path: Path, *args: str, ready: str) -> tuple[subprocess.Popen[str], str]:
    """An `atropos` process; returns it and the log line that says it is ready."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", command, "--config", str(path), *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stderr=subprocess.PIPE, text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if re.search(ready, line):
            # Keep reading stderr so the process never blocks on a full pipe.
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, line
    raise SystemExit(f"atropos {command} did not start")


@asynccontextmanager
async def connect(server: dict[str, Any]) -> AsyncIterator[AsyncConnection]:
    engine = create_engine(TraceServerConfig.model_validate(server))
    try:
        async with engine.connect() as conn:
            yield conn
    finally:
        await engine.dispose()


async def count(server: dict[str, Any], where: sa.ColumnElement[bool]) -> int:
    async with connect(server) as conn:
        return int(await conn.scalar(sa.select(sa.func.count()).where(where)) or 0)


async def drained(server: dict[str, Any], batch_size: int) -> bool:
    """Nothing upstream, no batch undelivered, fewer than batch_size traces waiting."""
    upstream = await count(server, TRACES.c.stage.in_(("received", "accepted")))
    waiting = await count(server, TRACES.c.stage.in_(ELIGIBLE))
    undelivered = await count(server, BATCHES.c.state != "delivered")
    return upstream == 0 and undelivered == 0 and waiting < batch_size


async def by_stage(server: dict[str, Any]) -> dict[str, int]:
    async with connect(server) as conn:
        rows = await conn.execute(sa.select(TRACES.c.stage, sa.func.count())
                                  .group_by(TRACES.c.stage))
        return {stage: n for stage, n in rows.all()}


async def figures(server: dict[str, Any]) -> dict[str, Any]:
    async with connect(server) as conn:
        created = TRACES.c.created_at
        stored = await conn.execute(
            sa.select(sa.func.count(), sa.func.min(created), sa.func.max(created)))
        count_, first, last = stored.one()
        rows = (await conn.execute(
            sa.select(TRACES.c.created_at, BATCHES.c.delivered_at)
            .join(MEMBERS, MEMBERS.c.trace_id == TRACES.c.trace_id)
            .join(BATCHES, BATCHES.c.batch_id == MEMBERS.c.batch_id)
            .where(BATCHES.c.state == "delivered"))).all()
    below = await count(server, TRACES.c.stage == "below_threshold")
    lags = sorted((d - c).total_seconds() for c, d in rows)
    span = (max(d for _, d in rows) - first).total_seconds() if rows else 0.0
    q = statistics.quantiles(lags, n=100) if len(lags) > 1 else [lags[0] if lags else 0.0] * 99
    return {"stored": count_, "ingest_span": (last - first).total_seconds() if count_ else 0.0,
            "delivered": len(lags), "delivery_span": span, "below": below,
            "lag_p50": q[49], "lag_p99": q[98], "lag_max": lags[-1] if lags else 0.0}


def main() -> None:
    parser = load_arguments(__doc__)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--flush-interval", type=float, default=30)
    parser.add_argument("--worker-process", action="store_true",
                        help="run the stages in an `atropos worker` beside `serve --no-workers`"
                             " (no wake-ups cross processes: the worker polls every "
                             "flush_interval)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        server = trace_server(args, workdir) | {"flush_interval_seconds": args.flush_interval}
        config = {"trace_server": server,
                  "distributor": {"target": "jsonl", "batch_size": args.batch_size,
                                  "output_dir": str(workdir / "batches")}}
        path = workdir / "config.json"
        path.write_text(json.dumps(config))
        apart = ("--no-workers",) if args.worker_process else ()
        hub, line = start("serve", path, *apart, ready=r"listening on [\d.]+:\d+")
        port = int(line.rsplit(":", 1)[1])
        procs = [hub]
        if args.worker_process:
            procs.append(start("worker", path, ready="pipeline ready")[0])
        try:
            ingest = asyncio.run(load("127.0.0.1", port, "/v1/traces", args.clients,
                                      args.seconds, args.trace_kb))
            stopped = time.monotonic()
            at_stop = asyncio.run(by_stage(server))
            while not asyncio.run(drained(server, args.batch_size)):
                if time.monotonic() - stopped > 10 * args.flush_interval + 60:
                    raise SystemExit("the pipeline did not drain")
                time.sleep(0.2)
            drain_seconds = time.monotonic() - stopped
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait()
        result = asyncio.run(figures(server))

    ingest_rate = result["stored"] / result["ingest_span"] if result["ingest_span"] else 0.0
    delivered_rate = (result["delivered"] / result["delivery_span"]
                      if result["delivery_span"] else 0.0)
    print(f"pipeline: {args.db}, {args.clients} clients, {ingest.body_kb:.1f} KB traces, "
          f"{args.seconds:.0f} s, batch_size {args.batch_size}, flush_interval "
          f"{args.flush_interval:g} s, jsonl target, stages "
          f"{'in a worker process' if args.worker_process else 'in the serve process'}")
    print(f"  ingest: {ingest.acked_per_s:.0f} acked traces/s (p99 {ingest.p99_ms:.1f} ms, "
          f"errors {sum(ingest.errors.values())}); {result['stored']} stored")
    print(f"  delivered: {result['delivered']} traces in batches "
          f"({result['below']} below threshold, the rest short of a full batch); "
          f"end to end {delivered_rate:.0f} traces/s vs ingest {ingest_rate:.0f} traces/s; "
          f"drained {drain_seconds:.1f} s after ingest stopped")
    print(f"  traces by stage when ingest stopped: {at_stop}")
    print(f"  lag ingest -> delivery: p50 {result['lag_p50']:.2f} s  p99 {result['lag_p99']:.2f} s"
          f"  max {result['lag_max']:.2f} s  (bound: 2 x flush_interval = "
          f"{2 * args.flush_interval:g} s)")
    print("reproduce: python bench/pipeline.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
