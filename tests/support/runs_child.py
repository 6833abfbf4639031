"""A stand-in for a trainer or an environment process, driven by its arguments.

It appends what happens to it to --events (one JSON line each: name, event, time), so
that tests can check start and stop order without reading the hub's mind.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--serve", type=int, help="answer 200 on this port ...")
    parser.add_argument("--serve-after", type=float, default=0, help="... from this second")
    parser.add_argument("--say", help="print this line ...")
    parser.add_argument("--say-after", type=float, default=0, help="... at this second")
    parser.add_argument("--exit-after", type=float, help="exit with --code at this second")
    parser.add_argument("--exit-when", help="exit with --code once this file exists")
    parser.add_argument("--code", type=int, default=0)
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--env-out", help="write the environment, as JSON, to this file")
    parser.add_argument("--print-env", help="print this variable's value")
    args = parser.parse_args()

    def event(what: str) -> None:
        line = json.dumps(
            {"name": args.name, "event": what, "t": time.time(), "pgid": os.getpgid(0)}
        )
        with open(args.events, "a") as f:
            f.write(line + "\n")

    def on_sigterm(*_: object) -> None:
        event("sigterm")
        if args.ignore_sigterm:
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    started = time.monotonic()
    event("start")
    print(f"{args.name} started", flush=True)
    if args.env_out:
        Path(args.env_out).write_text(json.dumps(dict(os.environ)))
    if args.print_env:
        print(f"{args.print_env} is {os.environ.get(args.print_env)}", flush=True)
    serving = said = False
    while True:
        elapsed = time.monotonic() - started
        if args.serve and not serving and elapsed >= args.serve_after:
            server = http.server.HTTPServer(("127.0.0.1", args.serve), _Ok)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            serving = True
            event("serving")
        if args.say and not said and elapsed >= args.say_after:
            print(f"some output, then {args.say} and more", flush=True)
            said = True
            event("said")
        if (args.exit_after is not None and elapsed >= args.exit_after) or (
            args.exit_when and os.path.exists(args.exit_when)
        ):
            event("exit")
            sys.exit(args.code)
        time.sleep(0.05)


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *_: object) -> None:
        pass


if __name__ == "__main__":
    main()
