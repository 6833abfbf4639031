"""From start to answering: how long `atropos serve` takes from the process starting
to its first 200 on GET /status, with the database already migrated (SQLite), beside
atroposlib's `run-api` started the same way; and how long the commands a new user
types first take, beside their targets (`atropos --help` and `--version` under 0.5 s,
a command at work within 1 s, a one-file import done within 2 s, serve answering
within 1 s).

    python bench/startup.py                 # 10 starts of each
    python bench/startup.py --runs 20 --only hub
    python bench/startup.py --only commands

atroposlib's `BaseEnv.get_status` gives up after three tries over about 1.5-3 s, and
its env process exits: a hub that restarts must answer well within that. Each start
is timed from just before the process is spawned to the first 200, polling every
10 ms; the CPU time its process tree had used by then is read too (on a machine
shared with other work, the wall time varies with the load; the CPU time much
less). The process is then stopped with SIGTERM. The hub is started as `atropos serve`
with its background stages (the default), so the tokenizer and the ingest processes
load as they do in production.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.atroposlib import install_atroposlib, start_run_api  # noqa: E402

Starter = Callable[[int], subprocess.Popen[bytes]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hub_starter(workdir: Path) -> Starter:
    db = workdir / "hub.db"

    def config(port: int) -> Path:
        path = workdir / "config.json"
        server = {"db_path": str(db), "host": "127.0.0.1", "port": port}
        path.write_text(json.dumps({"trace_server": server}))
        return path

    # Migrated once, beforehand: the starts measured find it up to date.
    subprocess.run(
        [sys.executable, "-m", "app.cli", "db", "upgrade", "--config", str(config(0))],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )

    def start(port: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--config", str(config(port))],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
            stderr=open(workdir / "hub.log", "ab"),  # noqa: SIM115 (the child's copy)
        )

    return start


def cpu_seconds(root: int) -> float:
    """User + system CPU time of a process and its descendants."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        pid = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(pid)
        ticks[pid] = int(fields[11]) + int(fields[12])
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total / os.sysconf("SC_CLK_TCK")


def time_start(start: Starter) -> tuple[float, float]:
    """Seconds from spawning to the first 200 on /status, and the CPU seconds used."""
    port = free_port()
    began = time.perf_counter()
    proc = start(port)
    try:
        with httpx.Client(timeout=5) as client:
            deadline = began + 60
            while time.perf_counter() < deadline:
                if proc.poll() is not None:
                    raise SystemExit(f"the server exited with {proc.returncode}")
                try:
                    if client.get(f"http://127.0.0.1:{port}/status").status_code == 200:
                        return time.perf_counter() - began, cpu_seconds(proc.pid)
                except httpx.TransportError:
                    pass
                time.sleep(0.01)
        raise SystemExit("the server did not answer within 60 s")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# (what is measured, the command after `atropos`, its target in seconds)
COMMANDS = (
    ("atropos --help", ["--help"], 0.5),
    ("atropos --version", ["--version"], 0.5),
    ("atropos db upgrade (at work)", ["db", "upgrade", "--config", "{config}"], 1.0),
    ("atropos import (one file)", ["import", "--config", "{config}", "{trace}"], 2.0),
)


def time_commands(workdir: Path, runs: int) -> None:
    """Each of COMMANDS `runs` times, interleaved; the median and p90 beside the target."""
    config = workdir / "commands.json"
    config.write_text(json.dumps({"trace_server": {"db_path": str(workdir / "commands.db")}}))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    times: dict[str, list[float]] = {}
    for n in range(runs):
        trace = workdir / f"trace-{n}.jsonl"  # a new trace each time: stored, not a duplicate
        trace.write_text(json.dumps({"task": f"Count the lines of notes-{n}.txt", "steps": [
            {"type": "final", "content": "12 " * 2700}]}) + "\n")
        for name, args, _ in COMMANDS:
            words = [a.format(config=config, trace=trace) for a in args]
            began = time.perf_counter()
            subprocess.run([sys.executable, "-m", "app.cli", *words], cwd=ROOT, env=env,
                           check=False, capture_output=True)
            times.setdefault(name, []).append(time.perf_counter() - began)
    print(f"commands, {runs} runs each (seconds)")
    print(f"{'':32}{'median':>10}{'p90':>10}{'target':>10}")
    for name, _, target in COMMANDS:
        runs_of = times[name]
        p90 = statistics.quantiles(runs_of, n=10)[-1] if len(runs_of) > 1 else runs_of[0]
        print(f"{name:32}{statistics.median(runs_of):10.2f}{p90:10.2f}{target:10.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--only", choices=["original", "hub", "commands"])
    parser.add_argument("--atroposlib", type=Path, help="a directory atroposlib is installed in")
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if args.only in (None, "commands"):
            time_commands(workdir, args.runs)
        if args.only == "commands":
            return
        starters: dict[str, Starter] = {}
        if args.only != "hub":
            atroposlib = args.atroposlib or install_atroposlib(workdir / "atroposlib")
            starters["atroposlib run-api"] = lambda port: start_run_api(atroposlib, port, workdir)
        if args.only != "original":
            starters["atropos-hub (sqlite)"] = hub_starter(workdir)
        for _ in range(args.runs):  # interleaved: both see the same load on the machine
            for name, start in starters.items():
                results.setdefault(name, []).append(time_start(start))
    print(f"start -> first 200 on GET /status, {args.runs} starts each (seconds)")
    print(f"{'':24}{'median':>10}{'p90':>10}{'max':>10}{'CPU median':>12}")
    for name, runs in results.items():
        times = [wall for wall, _ in runs]
        p90 = statistics.quantiles(times, n=10)[-1] if len(times) > 1 else times[0]
        cpu = statistics.median(cpu for _, cpu in runs)
        print(
            f"{name:24}{statistics.median(times):10.2f}{p90:10.2f}{max(times):10.2f}{cpu:12.2f}"
        )
    print("reproduce: python bench/startup.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
