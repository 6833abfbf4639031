"""Ingest benchmark: N concurrent HTTP clients on 127.0.0.1 post native traces to a
real `atropos serve` for a fixed time; prints acknowledged traces/s and latency, and,
in the same run, the ceiling of a bare aiosqlite writer doing the same inserts with
group commit (the hub's figures are best read as a ratio of that ceiling: machines
here are noisy).

    python bench/ingest.py                       # ~5 KB traces, 32 clients, 10 s
    python bench/ingest.py --trace-kb 50 --seconds 10
    python bench/ingest.py --db postgresql --database-url postgresql://user@127.0.0.1/db
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiosqlite

ROOT = Path(__file__).resolve().parents[1]


def make_trace(trace_kb: int) -> dict[str, object]:
    """A native trace of about `trace_kb` KB: thought / action / observation triples.
    Every thought carries the trace's id (__ID__), so no two traces share their text."""
    steps: list[dict[str, object]] = []
    size, i = 0, 0
    while size < trace_kb * 1000 - 400:
        thought = f"Step {i} of __ID__: the build failed on module {i}; read the log, retry."
        output = " ".join(f"line {i}.{j}: compiling src/module_{j}.py ... ok" for j in range(6))
        steps += [
            {"type": "thought", "content": thought},
            {"type": "action", "tool": "terminal", "call_id": f"c{i}",
             "arguments": {"command": f"make -C build target_{i}"}},
            {"type": "observation", "call_id": f"c{i}", "content": output, "exit_code": 0},
        ]
        size += len(json.dumps(steps[-3:]))
        i += 1
    steps.append({"type": "final", "content": "The build passes now."})
    return {"task": "Fix the failing build of the project.", "agent": {"model": "bench/model"},
            "env": "bench", "steps": steps, "outcome": {"status": "success"}}


def request_bytes(body: bytes, path: str) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def client(host: str, port: int, template: bytes, path: str, deadline: float,
                 latencies: list[float], errors: list[int]) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    while time.perf_counter() < deadline:
        body = template.replace(b"__ID__", uuid.uuid4().hex.encode())
        start = time.perf_counter()
        writer.write(request_bytes(body, path))
        status_line = await reader.readline()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await reader.readexactly(length)
        if status_line.split()[1] == b"202":
            latencies.append(time.perf_counter() - start)
        else:
            errors.append(int(status_line.split()[1]))
    writer.close()


async def load(host: str, port: int, path: str, clients: int, seconds: float,
               trace_kb: int) -> dict[str, float]:
    template = json.dumps({"trace_id": "__ID__", **make_trace(trace_kb)}).encode()
    latencies: list[float] = []
    errors: list[int] = []
    # Warm-up: connections, the ingest processes (~1 s to start), SQLite pages.
    await asyncio.gather(*(client(host, port, template, path, time.perf_counter() + 3,
                                  [], []) for _ in range(clients)))
    started = time.perf_counter()
    await asyncio.gather(*(client(host, port, template, path, started + seconds,
                                  latencies, errors) for _ in range(clients)))
    elapsed = time.perf_counter() - started
    qs = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0.0] * 99
    return {"acked_per_s": len(latencies) / elapsed, "p50_ms": qs[49] * 1000,
            "p99_ms": qs[98] * 1000, "errors": len(errors), "body_kb": len(template) / 1000}


async def bare_writer(db_path: Path, seconds: float, trace_kb: int) -> float:
    """The ceiling: one aiosqlite connection inserting the same rows, 256 per commit."""
    trace = json.dumps(make_trace(trace_kb))
    async with aiosqlite.connect(db_path) as db:
        await db.execute("PRAGMA journal_mode=WAL")
        await db.execute("PRAGMA synchronous=FULL")
        await db.execute("CREATE TABLE t (id TEXT PRIMARY KEY, created_at TEXT, original TEXT,"
                         " trace TEXT)")
        n, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            rows = [(uuid.uuid4().hex, "2026-01-01 00:00:00", trace, trace) for _ in range(256)]
            await db.executemany("INSERT INTO t VALUES (?, ?, ?, ?)", rows)
            await db.commit()
            n += len(rows)
        return n / (time.perf_counter() - started)


def start_hub(config: dict[str, object], workdir: Path) -> tuple[subprocess.Popen[str], int]:
    path = workdir / "config.json"
    path.write_text(json.dumps(config))
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--config", str(path), "--no-workers"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stderr=subprocess.PIPE, text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if m := re.search(r"listening on [\d.]+:(\d+)", line):
            return proc, int(m[1])
    raise SystemExit("the hub did not start")


def load_arguments(doc: str | None) -> argparse.ArgumentParser:
    """The options every benchmark that drives load shares."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--trace-kb", type=int, default=5)
    parser.add_argument("--db", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--database-url", default=os.environ.get("ATROPOS_TEST_DATABASE_URL"))
    return parser


def trace_server(args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    """config.json's trace_server section for --db: a SQLite file in `workdir`, or the
    PostgreSQL database --database-url names."""
    server: dict[str, object] = {"host": "127.0.0.1", "port": 0}
    if args.db == "sqlite":
        return server | {"storage_backend": "sqlite", "db_path": str(workdir / "bench.db")}
    if not args.database_url:
        raise SystemExit("--db postgresql needs --database-url")
    return server | {"storage_backend": "postgresql", "database_url": args.database_url}


def main() -> None:
    parser = load_arguments(__doc__)
    parser.add_argument("--hubs", type=int, default=1, help="hub processes sharing the load")
    parser.add_argument("--no-rules", action="store_true",
                        help="no reward rules or filters: the cost of scoring, by difference")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        server = trace_server(args, workdir)
        hubs = []
        for n in range(args.hubs):
            (workdir / str(n)).mkdir()
            config: dict[str, object] = {"trace_server": server}
            if args.no_rules:
                config["environment"] = {"reward_rules": {}, "invalid_trace_filters": []}
            hubs.append(start_hub(config, workdir / str(n)))
        try:
            per_hub = args.clients // len(hubs)

            async def run_all() -> list[dict[str, float]]:
                return await asyncio.gather(*(
                    load("127.0.0.1", port, "/v1/traces", per_hub, args.seconds, args.trace_kb)
                    for _, port in hubs))

            results = asyncio.run(run_all())
        finally:
            for proc, _ in hubs:
                proc.terminate()
                proc.wait()
        ceiling = asyncio.run(bare_writer(workdir / "bare.db", min(args.seconds, 5),
                                          args.trace_kb))

    total = sum(r["acked_per_s"] for r in results)
    print(f"ingest: {args.db}, {args.hubs} hub(s), {args.clients} clients, "
          f"{results[0]['body_kb']:.1f} KB traces, {args.seconds:.0f} s")
    for n, r in enumerate(results):
        print(f"  hub {n}: {r['acked_per_s']:.0f} acked traces/s  p50 {r['p50_ms']:.1f} ms  "
              f"p99 {r['p99_ms']:.1f} ms  errors {r['errors']:.0f}")
    print(f"  total: {total:.0f} acked traces/s")
    print(f"  bare aiosqlite writer, group commit: {ceiling:.0f} inserts/s "
          f"(hub = {total / ceiling:.0%} of it)")
    print("reproduce: python bench/ingest.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
