"""Ingest under wrk, as docs/ingest.md measures it: wrk (C, 2 threads, 32 connections) posts
distinct native traces to a real `atropos serve` on 127.0.0.1 (its stages on, as
users run it; `--no-workers`: the API alone) for a fixed time, after a
3 s warm-up. It prints the acknowledged traces/s, wrk's latency percentiles and the CPU
time per acknowledged trace of all the hub's processes (bench/ingest.py's measure), then
checks that every trace answered 202 is in the database. With the stages on it prints
their backlog one second after the load (bench/ingest.py's `stage_backlog`).

    python bench/wrk_ingest.py                    # ~5 KB traces, SQLite
    python bench/wrk_ingest.py --db postgresql    # a fresh database on $ATROPOS_TEST_DATABASE_URL
    python bench/wrk_ingest.py --tree ../old      # the hub of another checkout (a before)
    python bench/wrk_ingest.py --against ../old   # both hubs at once, half the connections each
    python bench/wrk_ingest.py --batch 100 --clients 8   # {"traces": [100 traces]} per request

--against runs the two hubs side by side, each loaded by its own wrk with half the
connections, over the same seconds: this machine's speed moves by tens of percent
within minutes, and two hubs measured together see the same machine, so the ratio of
their figures holds where runs one after the other do not.

wrk's own CPU is small (C), so the hub has more of the two cores than under
bench/ingest.py's Python clients. Needs `wrk` on PATH (Debian: apt-get install wrk).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from ingest import (
    ROOT,
    Backlog,
    CpuTimes,
    _database,
    gauge_line,
    hub_kind,
    load_arguments,
    machine_gauge,
    make_trace,
    missing,
    running,
    stage_backlog,
    start_hub,
    trace_server,
    workers_argument,
)

# Each request: the template with its __ID__ made unique (run, thread, counter). Each
# thread writes the trace_id of every 202 to a file of its own (args[3].<thread>);
# the counts are summed when wrk is done.
LUA = r"""
local threads = {}
function setup(thread)
  thread:set("tid", #threads)
  table.insert(threads, thread)
end
function init(args)
  local f = io.open(args[1], "rb"); template = f:read("*a"); f:close()
  prefix = args[2]; counter = 0; acked = 0; refused = 0
  ids = io.open(args[3] .. "." .. tid, "w")
end
function request()
  counter = counter + 1
  local body = template:gsub("__ID__", prefix .. tid .. "-" .. counter)
  return wrk.format("POST", "/v1/traces", {["Content-Type"] = "application/json"}, body)
end
function response(status, headers, body)
  if status == 202 then
    acked = acked + 1
    ids:write(body:match('"trace_id":"([^"]+)"'), "\n")
  elseif status == 207 then  -- a batch: an item stored is its 202 answer, with its id
    for id in body:gmatch('"trace_id":"([^"]+)"') do
      acked = acked + 1
      ids:write(id, "\n")
    end
    for _ in body:gmatch('"error":') do refused = refused + 1 end
  else
    refused = refused + 1
  end
end
function done(summary, latency, requests)
  local a, r = 0, 0
  for _, t in ipairs(threads) do a = a + t:get("acked"); r = r + t:get("refused") end
  io.write(string.format("RESULT acked=%d refused=%d p50=%.3f p99=%.3f\n",
    a, r, latency:percentile(50) / 1000, latency:percentile(99) / 1000))
end
"""


@dataclass
class Hub:
    tree: Path
    server: dict[str, object]
    proc: subprocess.Popen[str]
    port: int


def wrk(hubs: list[Hub], seconds: float, connections: int, template: Path, prefix: str,
        script: Path) -> list[tuple[dict[str, float], list[str]]]:
    """For each hub, at once: wrk's figures, and the trace_ids it was answered 202 for."""
    runs = [
        subprocess.Popen(
            ["wrk", "-t2", f"-c{connections}", f"-d{seconds:g}s", "-s", str(script),
             f"http://127.0.0.1:{hub.port}/v1/traces", "--", str(template), f"{prefix}{n}-",
             str(template.parent / f"{prefix}{n}-")],
            stdout=subprocess.PIPE, text=True,
        )
        for n, hub in enumerate(hubs)
    ]
    results = []
    for n, run in enumerate(runs):
        out, _ = run.communicate()
        if run.returncode:
            raise SystemExit(f"wrk failed ({run.returncode}):\n{out}")
        results.append(_figures(out, template.parent, f"{prefix}{n}-"))
    return results


def _figures(out: str, workdir: Path, prefix: str) -> tuple[dict[str, float], list[str]]:
    m = re.search(r"RESULT acked=(\d+) refused=(\d+) p50=([\d.]+) p99=([\d.]+)", out)
    if m is None:
        raise SystemExit(f"wrk printed no result:\n{out}")
    acked = [line for path in workdir.glob(prefix + ".*")
             for line in path.read_text().split()]
    return ({"acked": int(m[1]), "refused": int(m[2]), "p50": float(m[3]), "p99": float(m[4])},
            acked)


def main() -> None:
    parser = load_arguments(__doc__)
    workers_argument(parser)
    parser.add_argument("--tree", type=Path, default=ROOT,
                        help="the checkout whose hub is measured (default: this one)")
    parser.add_argument("--against", type=Path,
                        help="another checkout whose hub runs at the same time (half the "
                             "connections each)")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (Debian: apt-get install wrk)")
    trees = [args.tree.resolve()] + ([args.against.resolve()] if args.against else [])
    connections = args.clients // len(trees)
    gauge = machine_gauge()
    with _databases(args, len(trees)) as ons, tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        template = workdir / "trace.json"
        trace = make_trace(args.trace_kb)
        template.write_text(json.dumps(
            {"trace_id": "__ID__", **trace} if args.batch == 1
            else {"traces": [{"trace_id": f"__ID__-{i}", **trace} for i in range(args.batch)]}
        ))
        trace_kb = template.stat().st_size / 1000 / args.batch
        script = workdir / "ingest.lua"
        script.write_text(LUA)
        hubs = []
        for n, (tree, on) in enumerate(zip(trees, ons, strict=True)):
            (workdir / str(n)).mkdir()
            server = trace_server(on, workdir / str(n))
            proc, port = start_hub({"trace_server": server}, workdir / str(n), tree,
                                   workers=not args.no_workers)
            hubs.append(Hub(tree, server, proc, port))
        with running([hub.proc for hub in hubs]):
            run = uuid.uuid4().hex[:8]
            wrk(hubs, 3, connections, template, f"warm-{run}-", script)  # warm-up
            pids = [[hub.proc.pid] for hub in hubs]
            before = [CpuTimes.of(p) for p in pids]
            started = time.perf_counter()
            results = wrk(hubs, args.seconds, connections, template, f"m-{run}-", script)
            elapsed = time.perf_counter() - started
            after = [CpuTimes.of(p) for p in pids]
            backlogs: list[Backlog | None] = [None] * len(hubs)
            if not args.no_workers:
                time.sleep(1)  # the second the backlog is measured after
                backlogs = [stage_backlog(hub.server) for hub in hubs]
            lost = [missing(hub.server, ids) for hub, (_, ids) in zip(hubs, results, strict=True)]
    print(f"wrk ingest: {hub_kind(args)}; {args.db}, {connections} connections per hub, "
          f"{trace_kb:.1f} KB traces, {args.batch} per request, {args.seconds:g} s"
          + "".join(f", {s}" for s in args.set))
    per_trace = []
    for hub, (result, ids), cpu0, cpu1, gone, backlog in zip(
            hubs, results, before, after, lost, backlogs, strict=True):
        acked = max(result["acked"], 1)
        cpu = cpu1 - cpu0
        per_trace.append(cpu.total * 1000 / acked)
        print(f"  hub of {hub.tree}:")
        print(f"    {result['acked'] / elapsed:.0f} acked traces/s  p50 {result['p50']:.1f} ms  "
              f"p99 {result['p99']:.1f} ms  CPU {per_trace[-1]:.2f} ms/trace "
              f"({cpu.total / elapsed:.2f} cores; serving {cpu.serving * 1000 / acked:.2f}, "
              f"its event loop {cpu.event_loop * 1000 / acked:.2f})  refused {result['refused']}")
        print(f"    acknowledged but not in the database: {gone} (of {len(ids)})")
        if backlog is not None:
            print("  " + backlog.line())
        if gone or len(ids) != result["acked"]:
            raise SystemExit(f"{gone} acknowledged traces are not in the database")
    print(gauge_line(gauge, machine_gauge()))
    if len(hubs) == 2:
        rates = [r["acked"] for r, _ in results]
        print(f"  first / second: rate {rates[0] / max(rates[1], 1):.2f}x, "
              f"CPU per trace {per_trace[0] / per_trace[1]:.2f}x")
    print("reproduce: python bench/wrk_ingest.py " + " ".join(sys.argv[1:]))


@contextmanager
def _databases(args: argparse.Namespace, n: int) -> Iterator[list[argparse.Namespace]]:
    """`args` for each hub: on PostgreSQL each with a fresh database (bench/ingest.py's
    _database)."""
    with ExitStack() as stack:
        yield [stack.enter_context(_database(args)) for _ in range(n)]


if __name__ == "__main__":
    main()
