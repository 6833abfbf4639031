"""The Atropos API under load: atroposlib's original `run-api` and the hub, side by
side, with the same load.

    python bench/atropos.py                          # both servers, SQLite hub, 30 s
    python bench/atropos.py --db postgresql --database-url postgresql://...
    python bench/atropos.py --only hub --seconds 20
    python bench/atropos.py --only hub --workers     # the stages running too

For each server, one after the other on 127.0.0.1, each phase on a fresh process:
1. load: a trainer registers (batch_size sequences) and starts, an env registers
   (group size 8); then 32 concurrent keep-alive clients post groups of 8
   sequences x 512 tokens with messages (~73 KB of JSON each) to /scored_data for
   a fixed time, no trainer taking batches: groups acknowledged per second, server
   CPU per group, p50/p99 latency, peak RSS of the serving process and peak PSS of
   all its processes (the hub's ingest processes validate and deflate groups);
2. queue: the same clients fill an empty queue to exactly 10,000 groups (RSS read
   at 5,000 and 10,000); then a trainer calls GET /batch (Accept-Encoding: gzip, as
   `requests` sends) batch-calls times: p50/p99/max and server CPU per call; the
   first call forms every batch. With --workers, how many trajectories the env groups
   stage made a second meanwhile, of the groups' backlog.

Server CPU is counted over the server's process tree (for the hub: the serving
process, the fork server and the ingest processes).

The original is atroposlib's `atroposlib/api/server.py` from PyPI, installed with
`pip install --no-deps --target` into a temporary directory (its API server needs
only fastapi, pydantic and uvicorn, which the hub has) and run with this
interpreter, so both servers use the same FastAPI, uvicorn and uvloop. The hub
persists every group before answering (SQLite: WAL, synchronous=FULL).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.atroposlib import install_atroposlib, start_run_api  # noqa: E402

GROUP_SIZE = 8
TOKENS = 512
PROMPT = 128
CHECKPOINTS = (5_000, 10_000)


def make_group(rnd: random.Random) -> bytes:
    """8 sequences x 512 tokens, masks with a 128-token prompt, scores, and an
    OpenAI-style conversation per sequence: ~73 KB of JSON."""
    tokens = [[rnd.randrange(150_000) for _ in range(TOKENS)] for _ in range(GROUP_SIZE)]
    words = "the build failed on module so read the log and retry with the fix".split()
    messages = [
        [
            {"role": "system", "content": "You are a careful coding agent."},
            {"role": "user", "content": " ".join(rnd.choices(words, k=160))},
            {"role": "assistant", "content": " ".join(rnd.choices(words, k=240))},
        ]
        for _ in range(GROUP_SIZE)
    ]
    group = {
        "tokens": tokens,
        "masks": [[-100] * PROMPT + seq[PROMPT:] for seq in tokens],
        "scores": [rnd.choice([0.0, 1.0]) for _ in range(GROUP_SIZE)],
        "messages": messages,
        "env_id": 0,
    }
    return json.dumps(group).encode()


# --- a small HTTP/1.1 client: keep-alive, no per-request allocation of note ---------


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: str = ""
    ) -> tuple[int, bytes]:
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status = int((await self.reader.readline()).split()[1])
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


async def call(port: int, method: str, path: str, body: Any = None) -> Any:
    conn = await Connection.open(port)
    try:
        status, data = await conn.request(method, path, json.dumps(body).encode() if body else b"")
        assert status == 200, (path, status, data[:300])
        return json.loads(data)
    finally:
        conn.close()


# --- the server under test -------------------------------------------------------------


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    rss_samples: list[int] = field(default_factory=list)
    pss_samples: list[int] = field(default_factory=list)

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def tree(self) -> list[int]:
        """The server's pid and its descendants' (the fork server, ingest processes)."""
        children: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rpartition(")")[2].split()
            except OSError:
                continue  # gone meanwhile
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        pids, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            pids.append(pid)
            todo.extend(children.get(pid, []))
        return pids

    def pss_mb(self) -> float:
        """Proportional set size of the whole tree: shared pages counted once."""
        total = 0
        for pid in self.tree():
            try:
                lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
            except OSError:
                continue
            total += sum(int(line.split()[1]) for line in lines if line.startswith("Pss:"))
        return total / 1024

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server's process tree (all threads)."""
        ticks = 0
        for pid in self.tree():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            ticks += int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def start_original(atroposlib: Path, port: int, workdir: Path) -> Server:
    return Server("atroposlib run-api", start_run_api(atroposlib, port, workdir), port)


def start_hub(args: argparse.Namespace, port: int, workdir: Path) -> Server:
    server: dict[str, Any] = {"host": "127.0.0.1", "port": port}
    if args.db == "sqlite":
        server |= {"storage_backend": "sqlite", "db_path": str(workdir / "hub.db")}
    else:
        server |= {"storage_backend": "postgresql", "database_url": args.database_url}
    config = workdir / "config.json"
    config.write_text(json.dumps({"trace_server": server}))
    log = open(workdir / "hub.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--config", str(config),
         *([] if args.workers else ["--no-workers"])],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return Server(f"atropos-hub ({args.db})", proc, port)


async def wait_ready(server: Server) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise SystemExit(f"{server.name} exited with {server.proc.returncode}")
        try:
            await call(server.port, "GET", "/info")
            return
        except OSError:
            await asyncio.sleep(0.1)
    raise SystemExit(f"{server.name} did not start")


async def handshake(port: int, batch_size: int) -> None:
    conn = await Connection.open(port)
    try:  # an empty run (a PostgreSQL database is reused between phases)
        assert (await conn.request("GET", "/reset_data"))[0] == 200
    finally:
        conn.close()
    await call(
        port,
        "POST",
        "/register",
        {
            "wandb_group": "bench",
            "wandb_project": "bench",
            "batch_size": batch_size,
            "max_token_len": 4096,
            "checkpoint_dir": "/tmp/bench",
            "save_checkpoint_interval": 100,
            "starting_step": 0,
            "num_steps": 1000,
        },
    )
    await call(port, "GET", "/batch")  # the trainer starts
    env = {"max_token_length": 4096, "desired_name": "bench", "weight": 1.0}
    answer = await call(port, "POST", "/register-env", env | {"group_size": GROUP_SIZE})
    assert answer["status"] == "success", answer


# --- the load ---------------------------------------------------------------------------


@dataclass
class Load:
    posted: int = 0
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    rss_at: dict[int, float] = field(default_factory=dict)


async def post_groups(
    server: Server, body: bytes, clients: int, load: Load, *, until: float, target: int
) -> None:
    """`clients` connections posting `body` until the deadline or `target` groups."""

    async def one_client() -> None:
        conn = await Connection.open(server.port)
        try:
            while time.perf_counter() < until and load.posted < target:
                started = time.perf_counter()
                status, _ = await conn.request("POST", "/scored_data", body)
                if status != 200:
                    load.errors += 1
                    continue
                load.latencies.append(time.perf_counter() - started)
                load.posted += 1
                for mark in CHECKPOINTS:
                    if load.posted >= mark and mark not in load.rss_at:
                        load.rss_at[mark] = server.rss_mb()
        finally:
            conn.close()

    await asyncio.gather(*(one_client() for _ in range(clients)))


async def sample_rss(server: Server, stop: asyncio.Event) -> None:
    while not stop.is_set():
        server.rss_samples.append(int(server.rss_mb()))
        server.pss_samples.append(int(server.pss_mb()))
        await asyncio.sleep(0.2)


async def take_batches(port: int, calls: int) -> list[float]:
    conn = await Connection.open(port)
    latencies = []
    try:
        for _ in range(calls):
            started = time.perf_counter()
            status, data = await conn.request("GET", "/batch", headers="Accept-Encoding: gzip\r\n")
            latencies.append(time.perf_counter() - started)
            assert status == 200 and data, status
    finally:
        conn.close()
    return latencies


def quantile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] * 1000 if len(values) > 1 else float("nan")


async def measure_load(server: Server, args: argparse.Namespace, body: bytes) -> dict[str, Any]:
    """Phase 1: the fixed-time load."""
    await wait_ready(server)
    await handshake(server.port, args.batch_size)
    # Warm-up (connections, first inserts), then the timed load.
    warm = Load()
    await post_groups(server, body, args.clients, warm, until=time.perf_counter() + 1, target=200)
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(server, stop))
    load = Load(posted=warm.posted)
    cpu = server.cpu_seconds()
    started = time.perf_counter()
    deadline = started + args.seconds
    await post_groups(server, body, args.clients, load, until=deadline, target=10**9)
    elapsed = time.perf_counter() - started
    cpu_ms = (server.cpu_seconds() - cpu) * 1000 / max(len(load.latencies), 1)
    stop.set()
    await sampler
    return {
        "groups_per_s": len(load.latencies) / elapsed,
        "cpu_ms_per_group": cpu_ms,
        "p50_ms": quantile(load.latencies, 50),
        "p99_ms": quantile(load.latencies, 99),
        "errors": load.errors,
        "peak_rss_mb": max(server.rss_samples),
        "peak_pss_mb": max(server.pss_samples),
        "queued_after_load": (await call(server.port, "GET", "/status"))["queue_size"],
    }


async def measure_queue(server: Server, args: argparse.Namespace, body: bytes) -> dict[str, Any]:
    """Phase 2, on a fresh server: fill the queue to exactly 10,000 groups (memory
    read at 5,000 and 10,000), then a trainer takes batches."""
    await wait_ready(server)
    await handshake(server.port, args.batch_size)
    fill = Load()
    until = time.perf_counter() + 1800
    await post_groups(server, body, args.clients, fill, until=until, target=CHECKPOINTS[-1])
    queued = (await call(server.port, "GET", "/status"))["queue_size"]
    latencies = await take_batches(server.port, 1)  # forms every batch
    cpu = server.cpu_seconds()
    made, started = (await call(server.port, "GET", "/v1/stats"))["traces"], time.perf_counter()
    latencies += await take_batches(server.port, args.batch_calls - 1)
    cpu_ms = (server.cpu_seconds() - cpu) * 1000 / (args.batch_calls - 1)
    # With --workers, the env groups stage makes the backlog's trajectories meanwhile.
    made = ((await call(server.port, "GET", "/v1/stats"))["traces"] - made) / (
        time.perf_counter() - started)
    return {
        "rss_5000_mb": fill.rss_at.get(5_000, float("nan")),
        "rss_10000_mb": fill.rss_at.get(10_000, float("nan")),
        "queued": queued,
        "batch_first_ms": latencies[0] * 1000,
        "batch_p50_ms": quantile(latencies, 50),
        "batch_p99_ms": quantile(latencies, 99),
        "batch_max_ms": max(latencies) * 1000,
        "batch_cpu_ms": cpu_ms,
        "made_per_s": made,
    }


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per batch")
    parser.add_argument("--batch-calls", type=int, default=200)
    parser.add_argument("--only", choices=["original", "hub"])
    parser.add_argument("--workers", action="store_true",
                        help="the hub with its stages running (they make trajectories of "
                             "the groups), as `atropos serve` runs by default")
    parser.add_argument("--db", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--database-url", default=os.environ.get("ATROPOS_TEST_DATABASE_URL"))
    parser.add_argument("--atroposlib", type=Path, help="a directory atroposlib is installed in")
    args = parser.parse_args()
    if args.db == "postgresql" and not args.database_url:
        raise SystemExit("--db postgresql needs --database-url (an empty database)")
    body = make_group(random.Random(0))
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        starters: list[Any] = []
        if args.only != "hub":
            atroposlib = args.atroposlib or install_atroposlib(workdir / "atroposlib")
            starters.append(lambda phase: start_original(atroposlib, free_port(), workdir))
        if args.only != "original":
            starters.append(lambda phase: start_hub(args, free_port(), workdir / phase))
        for start in starters:
            figures: dict[str, Any] = {}
            for phase, measure in (("load", measure_load), ("queue", measure_queue)):
                (workdir / phase).mkdir(exist_ok=True)
                server = start(phase)
                try:
                    figures |= asyncio.run(measure(server, args, body))
                finally:
                    server.stop()
            if server.name.startswith("atropos-hub") and args.db == "sqlite":
                size = sum(p.stat().st_size for p in (workdir / "queue").glob("hub.db*"))
                figures["disk_mb"] = size / 1e6
            results[server.name] = figures
    report(args, body, results)


def report(args: argparse.Namespace, body: bytes, results: dict[str, dict[str, Any]]) -> None:
    print(
        f"Atropos API: {args.clients} clients, groups of {GROUP_SIZE} x {TOKENS} tokens with "
        f"messages ({len(body) / 1000:.0f} KB JSON), {args.seconds:.0f} s; then, on a fresh "
        f"server, GET /batch x{args.batch_calls} (batch_size {args.batch_size}) at 10,000 queued"
    )
    rows = [
        ("groups/s (acknowledged)", "groups_per_s", "{:.0f}"),
        ("server CPU ms per group", "cpu_ms_per_group", "{:.2f}"),
        ("POST /scored_data p50 ms", "p50_ms", "{:.1f}"),
        ("POST /scored_data p99 ms", "p99_ms", "{:.1f}"),
        ("errors", "errors", "{:.0f}"),
        ("RSS MB with 5,000 queued", "rss_5000_mb", "{:.0f}"),
        ("RSS MB with 10,000 queued", "rss_10000_mb", "{:.0f}"),
        ("peak RSS MB during the load", "peak_rss_mb", "{:.0f}"),
        ("peak PSS MB, all processes", "peak_pss_mb", "{:.0f}"),
        ("groups queued after the load", "queued_after_load", "{:.0f}"),
        ("GET /batch first (forms) ms", "batch_first_ms", "{:.1f}"),
        ("GET /batch p50 ms", "batch_p50_ms", "{:.1f}"),
        ("GET /batch p99 ms", "batch_p99_ms", "{:.1f}"),
        ("GET /batch max ms", "batch_max_ms", "{:.1f}"),
        ("server CPU ms per GET /batch (not first)", "batch_cpu_ms", "{:.2f}"),
        ("trajectories made per s meanwhile", "made_per_s", "{:.0f}"),
        ("database on disk MB, 10,000 queued", "disk_mb", "{:.0f}"),
    ]
    names = list(results)
    print(f"{'':42}" + "".join(f"{n:>26}" for n in names))
    for label, key, fmt in rows:
        cells = [fmt.format(results[n][key]) if key in results[n] else "-" for n in names]
        print(f"{label:42}" + "".join(f"{c:>26}" for c in cells))
    if len(names) == 2:
        ratio = results[names[1]]["groups_per_s"] / results[names[0]]["groups_per_s"]
        print(f"hub / original groups/s: {ratio:.2f}x")
    print("reproduce: python bench/atropos.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
