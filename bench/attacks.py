"""Replays the denial-of-service attacks of docs/access.md against a real `atropos serve` and
prints what each cost: the time to an answer, the answer, and the serving process's
memory peak above its level before (VmHWM - VmRSS, from /proc).

    python bench/attacks.py                      # this tree
    python bench/attacks.py --root /path/to/other/checkout --timeout 60

`--root` runs another checkout's hub (e.g. the code before the fixes) with this
script; an attack still unanswered after `--timeout` seconds is printed as such.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class Hub:
    def __init__(self, root: Path, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "config.json"
        config.write_text(json.dumps({
            "trace_server": {"host": "127.0.0.1", "port": 0, "db_path": str(workdir / "t.db")},
            "limits": {"max_step_chars": 2_000_000},
        }))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--config", str(config), "--no-workers"],
            cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
            stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if match := re.search(r"listening on ([\d.]+):(\d+)", line):
                self.host, self.port = match[1], int(match[2])
                break
        else:
            raise SystemExit("the hub did not start")
        self.url = f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        """The hub and everything it started (an ingest process stuck in a regex, too)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def post(hub: Hub, path: str, body: bytes, headers: dict[str, str], timeout: float) -> str:
    rss = _kb(hub.proc.pid, "VmRSS")
    started = time.monotonic()
    try:
        r = httpx.post(hub.url + path, content=body, headers=headers, timeout=timeout)
        answer = f"{r.status_code} {r.text[:90]!r}"
    except httpx.TimeoutException:
        answer = f"no answer after {timeout:g} s"
    took = time.monotonic() - started
    peak = _kb(hub.proc.pid, "VmHWM") - rss
    return f"{took:7.2f} s  peak +{peak / 1024:6.0f} MB  {answer}"


def half_sent(hub: Hub, count: int, wait: float) -> str:
    socks = []
    for _ in range(count):
        sock = socket.create_connection((hub.host, hub.port))
        sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: hub\r\nContent-Le")
        socks.append(sock)
    started = time.monotonic()
    try:
        code = str(httpx.get(hub.url + "/healthz", timeout=10).status_code)
    except httpx.HTTPError as exc:
        code = type(exc).__name__
    healthz = time.monotonic() - started
    deadline = time.monotonic() + wait
    closed = 0
    for sock in socks:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            while sock.recv(4096):
                pass
            closed += 1
        except (TimeoutError, ConnectionResetError):
            pass
        sock.close()
    return f"/healthz {code} in {healthz:.2f} s; closed by the hub within {wait:g} s: {closed}"


def log_tail(root: Path, workdir: Path) -> str:
    log = workdir / "big.log"
    with open(log, "wb") as f:
        for _ in range(64):
            f.write(b"x" * 2**20)
    code = ("import sys, time; from pathlib import Path; from app.runs.logs import tail;"
            "t = time.monotonic(); lines = tail(Path(sys.argv[1]), 1);"
            "print(f'{time.monotonic() - t:7.2f} s  answered {sum(map(len, lines))} chars')")
    out = subprocess.run([sys.executable, "-c", code, str(log)], cwd=root, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(root)}, check=True)
    return out.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose hub runs")
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--half-sent", type=int, default=2000)
    args = parser.parse_args()
    gz = {"content-encoding": "gzip", "content-type": "application/json"}
    empties = [b"{}"] * 1_000_000

    def hermes(kb: int) -> bytes:
        turn = "<tool_call> " * (kb * 1000 // 12)
        return json.dumps({"conversations": [{"from": "human", "value": "go"},
                                             {"from": "gpt", "value": turn}]}).encode()

    attacks = [
        ("ShareGPT, 144 KB of '<tool_call> '", "/v1/traces", hermes(144),
         {"content-type": "application/json"}),
        ("ShareGPT, 1 MB of '<tool_call> '", "/v1/traces", hermes(1000),
         {"content-type": "application/json"}),
        ("/scored_data_list, 1M {} (gzip)", "/scored_data_list",
         gzip.compress(b"[" + b",".join(empties) + b"]"), gz),
        ("/v1/traces array, 1M {} (gzip)", "/v1/traces",
         gzip.compress(b"[" + b",".join(empties) + b"]"), gz),
        ("/v1/traces NDJSON, 11M {} lines (gzip)", "/v1/traces",
         gzip.compress(b"\n".join([b"{}"] * 11_000_000)),
         {**gz, "content-type": "application/x-ndjson"}),
    ]
    print(f"hub from {args.root}")
    print(f"reproduce: python bench/attacks.py --root {args.root} --timeout {args.timeout:g}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, path, body, headers in attacks:
            hub = Hub(args.root, Path(tmp) / name.replace(" ", "_").replace("/", "_"))
            try:
                # Warm: the ingest processes start and load the tokenizer on the first trace.
                httpx.post(hub.url + "/v1/traces", json={"task": "warm", "steps": []}, timeout=60)
                print(f"{name:42s} {post(hub, path, body, headers, args.timeout)}")
            finally:
                hub.stop()
        hub = Hub(args.root, Path(tmp) / "slow")
        try:
            name = f"{args.half_sent} half-sent requests"
            print(f"{name:42s} {half_sent(hub, args.half_sent, 15)}")
        finally:
            hub.stop()
        print(f"{'GET ?tail=1 of a 64 MB log, no newline':42s} {log_tail(args.root, Path(tmp))}")


if __name__ == "__main__":
    main()
