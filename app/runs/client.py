"""`atropos run`: start a run on a hub, print its changes as they happen, stop it on
Ctrl-C.

    atropos run --url http://127.0.0.1:8000 \\
        --trainer "python launch_training.py --config run.yaml" \\
        --trainer-health "log:Starting training" \\
        --env "python my_env.py serve" --env-health alive:10

The run lives on the hub, not in this command: if the hub restarts meanwhile, the
command waits for it and carries on following the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import httpx

from app.access.keys import bearer_from_env
from app.runs.process import describe_exit
from app.waits import event_set_within

FINISHED = {"completed", "failed", "stopped"}
# Exit codes: the run completed, failed (or was stopped by someone else), was stopped
# by Ctrl-C here, or could not be started at all.
_CODES = {"completed": 0, "failed": 1, "stopped": 1}
_INTERRUPTED = 130
_USAGE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the hub")
    parser.add_argument(
        "--api-key-env",
        default="ATROPOS_API_KEY",
        help="the environment variable holding an admin API key, when the hub has "
        "auth.enabled (default ATROPOS_API_KEY)",
    )
    parser.add_argument("--trainer", metavar="CMD", help="the trainer's command line")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="CMD",
        help="an environment's command line (repeat for more; started in this order)",
    )
    parser.add_argument(
        "--trainer-health",
        type=parse_health,
        metavar="H",
        help="http://URL (answers 2xx), log:TEXT (a line of output contains TEXT) or alive:N",
    )
    parser.add_argument(
        "--env-health",
        type=parse_health,
        action="append",
        default=[],
        metavar="H",
        help="the health check of the environment given at the same position",
    )
    parser.add_argument(
        "--start-timeout", type=float, metavar="S", help="seconds each health check may take"
    )
    parser.add_argument(
        "--cwd", metavar="DIR", help="the processes' working directory on the hub's machine"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        dest="env_vars",
        help="an environment variable for the processes (stored with the run: no secrets)",
    )
    parser.add_argument(
        "--poll-interval", type=float, metavar="S", help="seconds between the hub's checks"
    )
    parser.add_argument(
        "--stop-timeout", type=float, metavar="S", help="seconds from SIGTERM to SIGKILL"
    )
    parser.add_argument(
        "--spec", type=Path, metavar="FILE", help="a JSON run spec, instead of the above"
    )
    parser.add_argument(
        "--watch-interval",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between looks at the run (default 1)",
    )


def parse_health(text: str) -> dict[str, Any]:
    if text.startswith(("http://", "https://")):
        return {"http": text}
    kind, sep, value = text.partition(":")
    if sep and kind == "log" and value:
        return {"log": value}
    if sep and kind == "alive":
        try:
            return {"alive_seconds": float(value)}
        except ValueError:
            pass
    raise argparse.ArgumentTypeError(
        f"{text!r}: use http://HOST:PORT/PATH, log:TEXT or alive:SECONDS"
    )


def build_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The run spec the arguments describe; ValueError says what is missing."""
    if args.spec:
        spec: dict[str, Any] = json.loads(args.spec.read_text())
        return spec
    if not args.trainer:
        raise ValueError("give the trainer's command (--trainer CMD) or a spec (--spec FILE)")
    if len(args.env_health) > len(args.env):
        raise ValueError("more --env-health than --env: each belongs to the --env at its position")

    def process(command: str, health: dict[str, Any] | None) -> dict[str, Any]:
        entry: dict[str, Any] = {"command": shlex.split(command)}
        if health:
            entry["health"] = health
        if args.start_timeout is not None:
            entry["start_timeout"] = args.start_timeout
        return entry

    env_health = args.env_health + [None] * (len(args.env) - len(args.env_health))
    spec = {
        "trainer": process(args.trainer, args.trainer_health),
        "environments": [process(c, h) for c, h in zip(args.env, env_health)],
        "env": dict(_assignment(item) for item in args.env_vars),
    }
    for key in ("cwd", "poll_interval", "stop_timeout"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    return spec


async def main(args: argparse.Namespace) -> int:
    # httpx logs every request at INFO: one line a second would drown the run's own.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        spec = build_spec(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return _USAGE
    headers = bearer_from_env(args.api_key_env)
    async with httpx.AsyncClient(base_url=args.url, timeout=30, headers=headers) as client:
        try:
            response = await client.post("/v1/runs", json=spec)
        except httpx.HTTPError as exc:
            print(f"error: cannot reach the hub at {args.url}: {exc}", file=sys.stderr)
            return _USAGE
        if response.status_code != 201:
            print(f"error: {_error_message(response)}", file=sys.stderr)
            return _USAGE
        created = response.json()
        follower = _Follower(client, created["run_id"], args.watch_interval)
        follower.status(created["status"], None)
        return await follower.run()


class _Follower:
    """Prints what changes in the run; the first Ctrl-C stops it, the second leaves."""

    def __init__(self, client: httpx.AsyncClient, run_id: str, interval: float) -> None:
        self.client = client
        self.run_id = run_id
        self.interval = interval
        self.interrupts = 0
        self.woken = asyncio.Event()
        self.seen: dict[str, Any] = {}
        self.unreachable = False

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, self._interrupt)
        stop_sent = False
        try:
            while True:
                if self.interrupts >= 2:
                    _say(f"run {self.run_id}: left it to the hub, which is stopping it")
                    return _INTERRUPTED
                if self.interrupts and not stop_sent:
                    stop_sent = await self._send_stop()
                run = await self._look()
                if run is not None and run["status"] in FINISHED:
                    if stop_sent and run["status"] == "stopped":
                        return _INTERRUPTED
                    return _CODES[run["status"]]
                self.woken.clear()
                await event_set_within(self.woken, self.interval)
        finally:
            loop.remove_signal_handler(signal.SIGINT)

    def _interrupt(self) -> None:
        self.interrupts += 1
        if self.interrupts == 1:
            _say("  (stopping the run; Ctrl-C again to leave without waiting)")
        self.woken.set()

    async def _send_stop(self) -> bool:
        try:
            response = await self.client.delete(f"/v1/runs/{self.run_id}")
        except httpx.HTTPError:
            return False  # the hub is away; asked again at the next look
        return response.status_code in (202, 409)  # 409: it had already ended

    async def _look(self) -> dict[str, Any] | None:
        try:
            response = await self.client.get(f"/v1/runs/{self.run_id}")
            response.raise_for_status()
        except httpx.HTTPError as exc:
            if not self.unreachable:
                _say(f"run {self.run_id}: the hub does not answer ({exc}); still trying")
            self.unreachable = True
            return None
        self.unreachable = False
        run: dict[str, Any] = response.json()
        self._print_changes(run)
        return run

    def _print_changes(self, run: dict[str, Any]) -> None:
        exited = []
        for proc in run["processes"]:
            before = self.seen.get(proc["role"], {})
            if proc["pid"] is not None and before.get("pid") is None:
                _say(f"  {proc['role']}: pid {proc['pid']}, log {proc['log_path']}")
            if proc["exited_at"] is not None and before.get("exited_at") is None:
                exited.append(proc)
            self.seen[proc["role"]] = proc
        # In the order they ended (a stop goes environments first), not the spec's.
        for proc in sorted(exited, key=lambda p: str(p["exited_at"])):
            _say(f"  {proc['role']}: exited with {describe_exit(proc['exit_code'])}")
        self.status(run["status"], run["error_message"])

    def status(self, status: str, error_message: str | None) -> None:
        if status != self.seen.get("status"):
            detail = f": {error_message}" if error_message else ""
            _say(f"run {self.run_id}: {status}{detail}")
            self.seen["status"] = status


def _assignment(item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name:
        raise ValueError(f"--set {item!r}: use NAME=VALUE")
    return name, value


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json()["error"]
        return f"{error['message']} (HTTP {response.status_code})"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:200]}"


def _say(line: str) -> None:
    print(line, flush=True)
