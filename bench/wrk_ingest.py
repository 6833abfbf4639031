"""Ingest under wrk, as issue 20 measured it: wrk (C, 2 threads, 32 connections) posts
distinct native traces to a real `atropos serve` on 127.0.0.1 for a fixed time, after a
3 s warm-up. It prints the acknowledged traces/s, wrk's latency percentiles and the CPU
time per acknowledged trace of all the hub's processes (bench/ingest.py's measure), then
checks that every trace answered 202 is in the database.

    python bench/wrk_ingest.py                    # ~5 KB traces, SQLite
    python bench/wrk_ingest.py --db postgresql    # a fresh database on $ATROPOS_TEST_DATABASE_URL
    python bench/wrk_ingest.py --tree ../old      # the hub of another checkout (a before)

wrk's own CPU is small (C), so the hub has more of the two cores than under
bench/ingest.py's Python clients. Needs `wrk` on PATH (Debian: apt-get install wrk).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from ingest import (
    ROOT,
    _database,
    load_arguments,
    make_trace,
    missing,
    running,
    start_hub,
    trace_server,
    tree_cpu,
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


def wrk(port: int, seconds: float, connections: int, template: Path, prefix: str,
        script: Path) -> tuple[dict[str, float], list[str]]:
    """wrk's figures, and the trace_ids it was answered 202 for."""
    ids = template.parent / prefix
    out = subprocess.run(
        ["wrk", "-t2", f"-c{connections}", f"-d{seconds:g}s", "-s", str(script),
         f"http://127.0.0.1:{port}/v1/traces", "--", str(template), prefix, str(ids)],
        capture_output=True, text=True, check=True,
    ).stdout
    m = re.search(r"RESULT acked=(\d+) refused=(\d+) p50=([\d.]+) p99=([\d.]+)", out)
    if m is None:
        raise SystemExit(f"wrk printed no result:\n{out}")
    acked = [line for path in template.parent.glob(prefix + ".*")
             for line in path.read_text().split()]
    return ({"acked": int(m[1]), "refused": int(m[2]), "p50": float(m[3]), "p99": float(m[4])},
            acked)


def main() -> None:
    parser = load_arguments(__doc__)
    parser.add_argument("--tree", type=Path, default=ROOT,
                        help="the checkout whose hub is measured (default: this one)")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (Debian: apt-get install wrk)")
    with _database(args) as url, tempfile.TemporaryDirectory() as tmp:
        if url is not None:
            args.database_url = url
        workdir = Path(tmp)
        template = workdir / "trace.json"
        template.write_text(json.dumps({"trace_id": "__ID__", **make_trace(args.trace_kb)}))
        trace_kb = template.stat().st_size / 1000
        script = workdir / "ingest.lua"
        script.write_text(LUA)
        server = trace_server(args, workdir)
        proc, port = start_hub({"trace_server": server}, workdir, args.tree.resolve())
        with running([proc]):
            run = uuid.uuid4().hex[:8]
            wrk(port, 3, args.clients, template, f"warm-{run}-", script)  # warm-up
            before = tree_cpu([proc.pid])
            serving_before = tree_cpu([proc.pid], descendants=False)
            started = time.perf_counter()
            result, acked_ids = wrk(port, args.seconds, args.clients, template, f"m-{run}-",
                                    script)
            elapsed = time.perf_counter() - started
            cpu = tree_cpu([proc.pid]) - before
            serving = tree_cpu([proc.pid], descendants=False) - serving_before
            lost = missing(server, acked_ids)
    acked = max(result["acked"], 1)
    print(f"wrk ingest: {args.db}, {args.clients} connections, "
          f"{trace_kb:.1f} KB traces, {args.seconds:g} s, hub of {args.tree}"
          + "".join(f", {s}" for s in args.set))
    print(f"  {result['acked'] / elapsed:.0f} acked traces/s  p50 {result['p50']:.1f} ms  "
          f"p99 {result['p99']:.1f} ms  CPU {cpu * 1000 / acked:.2f} ms/trace "
          f"({cpu / elapsed:.2f} cores; serving {serving * 1000 / acked:.2f})  "
          f"refused {result['refused']}")
    print(f"  acknowledged but not in the database: {lost} (of {len(acked_ids)})")
    print("reproduce: python bench/wrk_ingest.py " + " ".join(sys.argv[1:]))
    if lost or len(acked_ids) != result["acked"]:
        raise SystemExit(f"{lost} acknowledged traces are not in the database")


if __name__ == "__main__":
    main()
