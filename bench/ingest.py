"""Ingest benchmark: N concurrent HTTP clients on 127.0.0.1 post native traces to a
real `atropos serve` as users run it (its background stages on; `--no-workers`: the API
alone) for a fixed time, then, in the same run and with the same clients,
to the minimal endpoint of bench/minimal_ingest.py (pydantic validation, inline
tiktoken count, group commit to SQLite WAL). It prints for each the acknowledged
traces/s, p50/p99 latency and the CPU time per acknowledged trace of all its processes
together (the hub's serving processes, fork server and ingest processes, from /proc),
and the ratio hub / minimal, which is what to read on a noisy machine. Every
acknowledged trace is then looked up in the hub's database: one missing fails the run.
With the stages on, it also prints their backlog one second after the load: the traces
still waiting for a stage (`stage_backlog`), as a share of those stored.
A machine gauge (`machine_gauge`, a fixed piece of Python work timed before and after
the load) says how fast the machine ran: absolute figures of runs whose gauges differ
do not compare.

    python bench/ingest.py                       # ~5 KB traces, 32 clients, 10 s
    python bench/ingest.py --trace-kb 50
    python bench/ingest.py --batch 100           # {"traces": [100 traces]} per request
    python bench/ingest.py --db postgresql       # a fresh database on $ATROPOS_TEST_DATABASE_URL
    python bench/ingest.py --hubs 2 --no-minimal # two hubs on one database, each half the clients
    python bench/ingest.py --against ../old --rounds 4   # this hub / another checkout's, in turns
    python bench/ingest.py --db postgresql --hubs 2 --hub-cores 0.5   # scale-out, see below

Figures measured on the development machine, before and after, and what they mean:
docs/ingest.md. The clients run in this process (asyncio, one connection each) and use
CPU of the same two cores: their own CPU per request is printed too. With --db postgresql the
database server's CPU is not counted in the hub's figure; the minimal endpoint always
writes SQLite.

--against compares this checkout's hub with another's (a before) in place of the
minimal endpoint: each round loads both, one after the other, with the same clients,
each on a database of its own; the order alternates from round to round (AB, BA, ...),
so that a machine that speeds up or slows down during the run favours neither, and the
median ratio of the rounds is printed.

--hub-cores C holds each hub's processes to C cores between them (a cgroup's CPU quota;
needs root). On a machine of two cores one hub already keeps both busy, with the
database server and the clients, so a second hub can only share them; with each hub
held to less than its share, `--hubs 2` against `--hubs 1` measures what a second hub
adds where cores are not the limit: how much the hubs get in each other's way on one
database.
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
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_TICK = os.sysconf("SC_CLK_TCK")


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


def machine_gauge() -> float:
    """How fast this machine runs Python right now: CPU µs for a fixed piece of work
    (the 5 KB bench trace decoded with the standard library's json, its steps copied,
    encoded again), the median of 7 rounds. This machine's speed moves by tens of percent
    from minute to minute; runs whose gauges differ compare only as ratios."""
    text = json.dumps(make_trace(5))
    rounds = []
    for _ in range(7):
        started = time.process_time()
        for _ in range(300):
            trace = json.loads(text)
            steps = [dict(step, index=i) for i, step in enumerate(trace["steps"])]
            json.dumps({**trace, "steps": steps})
        rounds.append((time.process_time() - started) / 300 * 1e6)
    return statistics.median(rounds)


def gauge_line(before: float, after: float) -> str:
    return (f"  machine gauge: {before:.0f} µs before, {after:.0f} µs after "
            "(bench/ingest.py machine_gauge: the same work each time)")


def request_bytes(body: bytes, path: str) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


@dataclass
class Tally:
    """What the clients of one target saw."""

    latencies: list[float] = field(default_factory=list)  # per request answered 2xx
    acked: list[str] = field(default_factory=list)  # trace_ids acknowledged
    errors: dict[int, int] = field(default_factory=dict)  # status -> requests

    def refused(self, status: int) -> None:
        self.errors[status] = self.errors.get(status, 0) + 1


class Body:
    """Request bodies of distinct traces: one trace, or {"traces": [...]} of `batch`."""

    def __init__(self, trace_kb: int, batch: int) -> None:
        self.template = json.dumps({"trace_id": "__ID__", **make_trace(trace_kb)}).encode()
        self.batch = batch

    def next(self) -> tuple[bytes, list[str]]:
        ids = [uuid.uuid4().hex for _ in range(self.batch)]
        traces = [self.template.replace(b"__ID__", i.encode()) for i in ids]
        if self.batch == 1:
            return traces[0], ids
        return b'{"traces": [' + b",".join(traces) + b"]}", ids


async def client(host: str, port: int, bodies: Body, path: str, deadline: float,
                 tally: Tally) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    while time.perf_counter() < deadline:
        body, ids = bodies.next()
        start = time.perf_counter()
        writer.write(request_bytes(body, path))
        status_line = await reader.readline()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        answer = await reader.readexactly(length)
        status = int(status_line.split()[1])
        if status == 202:
            tally.latencies.append(time.perf_counter() - start)
            tally.acked += ids
        elif status == 207:
            tally.latencies.append(time.perf_counter() - start)
            results = json.loads(answer)["results"]
            tally.acked += [r["trace_id"] for r in results if "error" not in r]
            for r in results:
                if "error" in r:
                    tally.refused(207)
        else:
            tally.refused(status)
    writer.close()


@dataclass
class Figures:
    """One target under load, over the measured window."""

    acked_per_s: float
    p50_ms: float
    p99_ms: float
    errors: dict[int, int]  # status -> requests (207: items refused within a batch)
    body_kb: float  # one trace
    cpu_ms_per_trace: float  # all the target's processes together
    serving_ms_per_trace: float  # the serving processes alone
    event_loop_ms_per_trace: float  # their main threads (the rest: the SQLite writer's)
    cores: float  # the same, as cores busy
    client_ms_per_trace: float  # this process's CPU (the clients)
    acked: list[str]

    def line(self, name: str) -> str:
        errors = sum(self.errors.values())
        return (f"  {name}: {self.acked_per_s:.0f} acked traces/s  p50 {self.p50_ms:.1f} ms  "
                f"p99 {self.p99_ms:.1f} ms  CPU {self.cpu_ms_per_trace:.2f} ms/trace "
                f"({self.cores:.2f} cores; serving {self.serving_ms_per_trace:.2f}, "
                f"its event loop {self.event_loop_ms_per_trace:.2f})  "
                f"clients {self.client_ms_per_trace:.2f} ms/trace  "
                f"errors {errors}" + (f" {self.errors}" if errors else ""))


async def load(host: str, port: int, path: str, clients: int, seconds: float,
               trace_kb: int, batch: int = 1, pids: list[int] | None = None) -> Figures:
    """Warm up for 3 s, then load for `seconds`: the figures of that window. `pids`: the
    processes whose CPU time (with their descendants') is counted per trace."""
    bodies = Body(trace_kb, batch)
    # Warm-up: connections, the ingest processes (~1 s to start), SQLite pages.
    await asyncio.gather(*(client(host, port, bodies, path, time.perf_counter() + 3, Tally())
                           for _ in range(clients)))
    tally = Tally()
    pids = pids or []
    cpu_before, own_before = CpuTimes.of(pids), time.process_time()
    started = time.perf_counter()
    await asyncio.gather(*(client(host, port, bodies, path, started + seconds, tally)
                           for _ in range(clients)))
    elapsed = time.perf_counter() - started
    cpu, own = CpuTimes.of(pids) - cpu_before, time.process_time() - own_before
    qs = statistics.quantiles(tally.latencies, n=100) if len(tally.latencies) > 1 else [0.0] * 99
    acked = max(len(tally.acked), 1)
    return Figures(
        acked_per_s=len(tally.acked) / elapsed, p50_ms=qs[49] * 1000, p99_ms=qs[98] * 1000,
        errors=tally.errors, body_kb=len(bodies.template) / 1000,
        cpu_ms_per_trace=cpu.total * 1000 / acked,
        serving_ms_per_trace=cpu.serving * 1000 / acked,
        event_loop_ms_per_trace=cpu.event_loop * 1000 / acked, cores=cpu.total / elapsed,
        client_ms_per_trace=own * 1000 / acked, acked=tally.acked,
    )


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds (user + system) a hub has used so far: all its processes (`pids` and
    their descendants), its serving processes (`pids`), and their main threads, which run
    the event loops; a serving process's other CPU is its threads', chiefly the SQLite
    writer's (app/db/dialect.py OneHop)."""

    total: float
    serving: float
    event_loop: float

    @classmethod
    def of(cls, pids: list[int]) -> CpuTimes:
        return cls(tree_cpu(pids), tree_cpu(pids, descendants=False),
                   sum(_stat_cpu(f"/proc/{pid}/task/{pid}/stat")[1] for pid in pids))

    def __sub__(self, before: CpuTimes) -> CpuTimes:
        return CpuTimes(self.total - before.total, self.serving - before.serving,
                        self.event_loop - before.event_loop)


def tree_cpu(pids: list[int], *, descendants: bool = True) -> float:
    """CPU seconds (user + system) used so far by `pids` and all their descendants."""
    processes = _processes()
    counted = set(pids) | ({d for pid in pids for d in _descendants(pid, processes)}
                           if descendants else set())
    return sum(processes[pid][1] for pid in counted if pid in processes)


def _processes() -> dict[int, tuple[int, float]]:
    """Every process: its parent's pid and the CPU seconds it has used."""
    processes = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent, cpu = _stat_cpu(f"/proc/{entry}/stat")
            if parent >= 0:
                processes[int(entry)] = (parent, cpu)
    return processes


def _descendants(pid: int, processes: dict[int, tuple[int, float]]) -> list[int]:
    """The processes `pid` started, and theirs."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        children = [child for child, (p, _) in processes.items() if p == parent]
        found += children
        todo += children
    return found


def _stat_cpu(path: str) -> tuple[int, float]:
    """(parent pid, CPU seconds) from a /proc stat file; (-1, 0.0) once it has ended."""
    try:
        with open(path, "rb") as f:
            stat = f.read()
    except OSError:
        return -1, 0.0
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def _drain(proc: subprocess.Popen[str]) -> None:
    """Keep reading the process's stderr so that it never blocks on a full pipe."""
    assert proc.stderr is not None
    threading.Thread(target=proc.stderr.read, daemon=True).start()


def _started(proc: subprocess.Popen[str], what: str) -> int:
    assert proc.stderr is not None
    for line in proc.stderr:
        if m := re.search(r"listening on [\d.]+:(\d+)", line):
            _drain(proc)
            return int(m[1])
    raise SystemExit(f"{what} did not start")


def start_hub(config: dict[str, object], workdir: Path, tree: Path = ROOT, *,
              workers: bool) -> tuple[subprocess.Popen[str], int]:
    """`atropos serve` of the checkout `tree` (this one by default); `workers`: with its
    background stages (the default of `atropos serve`), their batches written to
    `workdir`."""
    if workers:
        config = {"distributor": {"output_dir": str(workdir / "batches")}, **config}
    path = workdir / "config.json"
    path.write_text(json.dumps(config))
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--config", str(path),
         *(() if workers else ("--no-workers",))],
        cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
        stderr=subprocess.PIPE, text=True,
    )
    return proc, _started(proc, "the hub")


def hold_to_cores(pid: int, cores: float) -> None:
    """Hold the process `pid` and its descendants (those it starts later too) to
    `cores` CPUs between them: a cgroup of its own with a CPU quota, cgroup v1 or v2.
    The period is short (10 ms), so that the quota throttles in small steps."""
    period = 10_000  # µs
    quota = max(1_000, round(cores * period))
    v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
    for old in [*v1.glob("atropos-bench-*"), *v2.glob("atropos-bench-*")]:
        with suppress(OSError):  # an earlier run's, empty once its hub is gone
            old.rmdir()
    try:
        if (v1 / "cpu.cfs_quota_us").exists():
            group = v1 / f"atropos-bench-{pid}"
            group.mkdir(exist_ok=True)
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        elif "cpu" in (v2 / "cgroup.controllers").read_text().split():
            group = v2 / f"atropos-bench-{pid}"
            group.mkdir(exist_ok=True)
            (group / "cpu.max").write_text(f"{quota} {period}")
        else:
            raise OSError("no cgroup CPU controller")
        for each in [pid, *_descendants(pid, _processes())]:
            (group / "cgroup.procs").write_text(str(each))
    except OSError as exc:
        raise SystemExit(
            f"--hub-cores needs a writable cgroup CPU controller (root): {exc}") from None


def start_minimal(db_path: Path) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "minimal_ingest.py"), "--db", str(db_path)],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )
    return proc, _started(proc, "the minimal endpoint")


@contextmanager
def running(procs: list[subprocess.Popen[str]]) -> Iterator[None]:
    try:
        yield
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)


def load_arguments(doc: str | None) -> argparse.ArgumentParser:
    """The options every benchmark that drives load shares."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--trace-kb", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1,
                        help='traces per request, as {"traces": [...]} (answered 207)')
    parser.add_argument("--db", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--database-url", default=os.environ.get("ATROPOS_TEST_DATABASE_URL"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="a trace_server key for the hub, e.g. --set ingest_processes=3")
    return parser


def workers_argument(parser: argparse.ArgumentParser) -> None:
    """--no-workers, for the benchmarks that measure `atropos serve`."""
    parser.add_argument("--no-workers", action="store_true",
                        help="the hub without its background stages (`atropos serve "
                             "--no-workers`); by default they run, as `atropos serve` does")


def hub_kind(args: argparse.Namespace) -> str:
    return ("atropos serve --no-workers (no stages)" if args.no_workers
            else "atropos serve (the default: stages on)")


def trace_server(args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    """config.json's trace_server section for --db (a SQLite file in `workdir`, or the
    PostgreSQL database --database-url names), with --set's keys."""
    server: dict[str, object] = {"host": "127.0.0.1", "port": 0}
    if args.db == "sqlite":
        server |= {"storage_backend": "sqlite", "db_path": str(workdir / "bench.db")}
    elif not args.database_url:
        raise SystemExit("--db postgresql needs --database-url")
    else:
        server |= {"storage_backend": "postgresql", "database_url": args.database_url}
    for setting in args.set:
        key, _, value = setting.partition("=")
        server[key] = json.loads(value)
    return server


def _pg(url: str, sql: str, *args: object) -> object:
    import asyncpg

    async def run() -> object:
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
        try:
            return await conn.fetchval(sql, *args)
        finally:
            await conn.close()

    return asyncio.run(run())


@contextmanager
def fresh_pg_database(admin_url: str) -> Iterator[str]:
    """A new, empty database on the server `admin_url` names, dropped afterwards."""
    from sqlalchemy.engine import make_url

    name = f"bench_{uuid.uuid4().hex[:12]}"
    _pg(admin_url, f'CREATE DATABASE "{name}"')
    try:
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        _pg(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def missing(server: dict[str, object], ids: list[str]) -> int:
    """How many of `ids` are not in the hub's traces table."""
    if server["storage_backend"] == "sqlite":
        import sqlite3

        with sqlite3.connect(str(server["db_path"])) as db:
            db.execute("CREATE TEMP TABLE acked (trace_id TEXT PRIMARY KEY)")
            db.executemany("INSERT OR IGNORE INTO acked VALUES (?)", [(i,) for i in ids])
            (found,) = db.execute(
                "SELECT count(*) FROM acked JOIN traces USING (trace_id)").fetchone()
        return len(set(ids)) - int(found)
    found = _pg(str(server["database_url"]),
                "SELECT count(*) FROM traces WHERE trace_id = ANY($1::text[])", list(set(ids)))
    return len(set(ids)) - int(found)  # type: ignore[call-overload]


# Traces a background stage has yet to take: compression's (accepted); distribution's
# (eligible and under the threshold, or enough eligible for full batches); delivery's
# (in a batch not yet delivered). Eligible traces short of a full batch wait for more
# traces, not for a stage.
_BACKLOG = """
SELECT
  (SELECT count(*) FROM traces),
  (SELECT count(*) FROM traces WHERE stage = 'accepted'),
  (SELECT count(*) FROM traces WHERE stage IN ('compressed', 'compression_skipped')
   AND (reward IS NULL OR reward < {threshold}))
  + (SELECT count(*) FROM traces WHERE stage IN ('compressed', 'compression_skipped')
     AND reward >= {threshold}) / {size} * {size},
  (SELECT count(*) FROM batch_traces JOIN batches USING (batch_id)
   WHERE batches.state = 'pending')
"""


@dataclass(frozen=True)
class Backlog:
    """Traces stored, and those waiting for each stage."""

    stored: int
    compression: int
    distribution: int
    delivery: int

    def line(self) -> str:
        waiting = self.compression + self.distribution + self.delivery
        return (f"  stages' backlog 1 s after the load: {waiting} of {self.stored} traces "
                f"stored ({100 * waiting / max(self.stored, 1):.1f}%) still wait for a stage "
                f"(compression {self.compression}, distribution {self.distribution}, "
                f"delivery {self.delivery})")


def stage_backlog(server: dict[str, object], threshold: float = 5,
                  batch_size: int = 32) -> Backlog:
    """The traces waiting for each stage, by the distributor's defaults."""
    sql = _BACKLOG.format(threshold=float(threshold), size=int(batch_size))
    if server["storage_backend"] == "sqlite":
        import sqlite3

        with sqlite3.connect(str(server["db_path"])) as db:
            return Backlog(*(int(n) for n in db.execute(sql).fetchone()))
    import asyncpg

    async def run() -> Backlog:
        url = str(server["database_url"]).replace("postgresql+asyncpg", "postgresql")
        conn = await asyncpg.connect(url)
        try:
            row = await conn.fetchrow(sql)
        finally:
            await conn.close()
        assert row is not None
        return Backlog(*(int(n) for n in row))

    return asyncio.run(run())


def main() -> None:
    parser = load_arguments(__doc__)
    workers_argument(parser)
    parser.add_argument("--hubs", type=int, default=1, help="hub processes sharing the load")
    parser.add_argument("--no-minimal", action="store_true",
                        help="skip the minimal endpoint (no ratio)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="hub, minimal, hub, minimal...: the median ratio is printed")
    parser.add_argument("--against", type=Path,
                        help="another checkout whose hub is loaded in turn with this one's "
                             "(in place of the minimal endpoint)")
    parser.add_argument("--hub-cores", type=float,
                        help="hold each hub's processes to this many cores (root)")
    parser.add_argument("--no-rules", action="store_true",
                        help="no reward rules or filters: the cost of scoring, by difference")
    args = parser.parse_args()
    if args.against and args.hubs != 1:
        raise SystemExit("--against compares one hub with one hub")
    print(f"ingest: {hub_kind(args)}; {args.db}, {args.hubs} hub(s), {args.clients} clients, "
          f"{len(Body(args.trace_kb, 1).template) / 1000:.1f} KB traces, "
          f"{args.batch} per request, {args.seconds:.0f} s"
          + "".join(f", {s}" for s in args.set), flush=True)
    ratios, lost = [], 0
    gauge = machine_gauge()
    for round_ in range(args.rounds):
        if args.against:
            ratio, lost_now = against_round(args, this_first=round_ % 2 == 0)
            ratios.append(ratio)
            lost += lost_now
            continue
        with _database(args) as on, tempfile.TemporaryDirectory() as tmp:
            results, lost_now, backlog = hub_round(on, Path(tmp))
            lost += lost_now
            total = sum(r.acked_per_s for r in results)
            for n, r in enumerate(results):
                print(r.line(f"hub {n}"))
            if backlog is not None:
                print(backlog.line())
            if args.hubs > 1:
                print(f"  hubs total: {total:.0f} acked traces/s")
            print(f"  acknowledged but not in the database: {lost_now}", flush=True)
            if args.no_minimal:
                continue
            minimal = minimal_round(on, Path(tmp))
            print(minimal.line("minimal endpoint"))
            cpu = sum(r.cpu_ms_per_trace * r.acked_per_s for r in results) / total
            ratios.append((total / minimal.acked_per_s, cpu / minimal.cpu_ms_per_trace))
            print(f"  hub / minimal: {ratios[-1][0]:.2f}x the rate, "
                  f"{ratios[-1][1]:.2f}x the CPU per trace", flush=True)
    print(gauge_line(gauge, machine_gauge()))
    if len(ratios) > 1:
        print(f"  median of {len(ratios)} rounds: "
              f"{'this / other' if args.against else 'hub / minimal'} "
              f"{statistics.median(r for r, _ in ratios):.2f}x the rate, "
              f"{statistics.median(c for _, c in ratios):.2f}x the CPU per trace")
    print("reproduce: python bench/ingest.py " + " ".join(sys.argv[1:]))
    if lost:
        raise SystemExit(f"{lost} acknowledged traces are not in the database")


def hub_round(args: argparse.Namespace, workdir: Path,
              tree: Path = ROOT) -> tuple[list[Figures], int, Backlog | None]:
    """--hubs hubs of the checkout `tree` on one database under load; their figures,
    how many of the traces they acknowledged are not in the database, and with the
    stages on their backlog one second after the load (`stage_backlog`)."""
    server = trace_server(args, workdir)
    hubs = []
    for n in range(args.hubs):
        (workdir / str(n)).mkdir()
        config: dict[str, object] = {"trace_server": server}
        if args.no_rules:
            config["environment"] = {"reward_rules": {}, "invalid_trace_filters": []}
        hubs.append(start_hub(config, workdir / str(n), tree, workers=not args.no_workers))
        if args.hub_cores:
            hold_to_cores(hubs[-1][0].pid, args.hub_cores)
    with running([proc for proc, _ in hubs]):
        per_hub = args.clients // len(hubs)

        async def run_all() -> list[Figures]:
            return await asyncio.gather(*(
                load("127.0.0.1", port, "/v1/traces", per_hub, args.seconds,
                     args.trace_kb, args.batch, [proc.pid])
                for proc, port in hubs))

        results = asyncio.run(run_all())
        backlog = None
        if not args.no_workers:
            time.sleep(1)  # the second the backlog is measured after
            backlog = stage_backlog(server)
    return results, missing(server, [i for r in results for i in r.acked]), backlog


def against_round(args: argparse.Namespace,
                  this_first: bool) -> tuple[tuple[float, float], int]:
    """This checkout's hub and --against's, one after the other (this one first or
    last): the ratios of their rates and CPU per trace, and how many acknowledged traces
    are not in the databases."""
    trees = [ROOT, args.against.resolve()]
    figures, lost = {}, 0
    for tree in trees if this_first else trees[::-1]:
        # A database each: the other checkout's migrations may differ.
        with _database(args) as on, tempfile.TemporaryDirectory() as tmp:
            (figures[tree],), lost_now, backlog = hub_round(on, Path(tmp), tree)
        lost += lost_now
        print(figures[tree].line(f"hub of {tree}"))
        if backlog is not None:
            print("  " + backlog.line())
        print(f"    acknowledged but not in the database: {lost_now}", flush=True)
    this, other = (figures[tree] for tree in trees)
    ratio = (this.acked_per_s / other.acked_per_s,
             this.cpu_ms_per_trace / other.cpu_ms_per_trace)
    print(f"  this / other: {ratio[0]:.2f}x the rate, {ratio[1]:.2f}x the CPU per trace",
          flush=True)
    return ratio, lost


def minimal_round(args: argparse.Namespace, workdir: Path) -> Figures:
    path = "/v1/traces" if args.batch == 1 else "/v1/traces/batch"
    proc, port = start_minimal(workdir / "minimal.db")
    with running([proc]):
        return asyncio.run(load("127.0.0.1", port, path, args.clients, args.seconds,
                                args.trace_kb, args.batch, [proc.pid]))


@contextmanager
def _database(args: argparse.Namespace) -> Iterator[argparse.Namespace]:
    """`args`, with --db postgresql on a fresh database (--database-url names the server)."""
    if args.db != "postgresql":
        yield args
        return
    if not args.database_url:
        raise SystemExit("--db postgresql needs --database-url (or ATROPOS_TEST_DATABASE_URL)")
    with fresh_pg_database(args.database_url) as url:
        yield argparse.Namespace(**{**vars(args), "database_url": url})

if __name__ == "__main__":
    main()
