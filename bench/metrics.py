"""What the HTTP metrics middleware (app/api/http_metrics.py) costs per request: an
ASGI app that answers at once, called directly (no server, no socket), with and
without the middleware, in the same process; the difference is the middleware's
cost. Also the per-trace cost of counting an ingest outcome.

    python bench/metrics.py                 # 200,000 requests each way, best of 5
    python bench/metrics.py --requests 50000 --rounds 3

The figures are per call, in microseconds; on a shared machine compare the two lines
of one run, not runs with each other.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.api.http_metrics import RequestMetrics  # noqa: E402
from app.ingest import ingestor  # noqa: E402
from app.ingest.inserter import Stored  # noqa: E402

START = {"type": "http.response.start", "status": 202, "headers": []}
BODY = {"type": "http.response.body", "body": b"{}"}


class _Route:
    path = "/v1/traces"


async def app(scope: Any, receive: Any, send: Any) -> None:
    scope["route"] = _Route  # as the router sets it
    await send(START)
    await send(BODY)


async def receive() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


async def send(message: Any) -> None:
    pass


async def requests(handler: Any, n: int) -> float:
    scope = {"type": "http", "method": "POST", "path": "/v1/traces"}
    started = time.perf_counter()
    for _ in range(n):
        await handler(dict(scope), receive, send)
    return (time.perf_counter() - started) / n * 1e6


def outcomes(n: int) -> float:
    row = {"source_format": "native"}
    stored = Stored("t", "accepted", "success", 10, 30.0, None, None, None)
    started = time.perf_counter()
    for _ in range(n):
        ingestor._counted(row, stored, None)
    return (time.perf_counter() - started) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    bare = min(asyncio.run(requests(app, args.requests)) for _ in range(args.rounds))
    measured = min(asyncio.run(requests(RequestMetrics(app), args.requests))
                   for _ in range(args.rounds))
    counted = min(outcomes(args.requests) for _ in range(args.rounds))
    print(f"app alone:            {bare:6.2f} us/request")
    print(f"with RequestMetrics:  {measured:6.2f} us/request "
          f"(the middleware: {measured - bare:.2f} us)")
    print(f"an ingest outcome:    {counted:6.2f} us/trace")
    print(f"reproduce: python bench/metrics.py --requests {args.requests} --rounds {args.rounds}")


if __name__ == "__main__":
    main()
