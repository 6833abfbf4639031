"""Dashboard benchmark: a store of 100,000 traces, and the time a real `atropos serve`
takes to answer each kind of /ui/traces page (the list's filters, sorts, search and a
deep page by cursor), the overview and a trace's page, one request at a time on
127.0.0.1. Prints the median and p90 of each; the issue asks for every list page
under 300 ms.

The store is filled directly through the database (as if ingested: payloads of
--trace-kb, stages, statuses, rewards, reject reasons, reviews and batches in
proportions like a real store's), which takes a minute or two; --db-path keeps it for
the next run.

    python bench/dashboard.py                              # 100,000 traces, SQLite
    python bench/dashboard.py --db-path /tmp/dash.db       # keep (or reuse) the store
    python bench/dashboard.py --db postgresql --database-url postgresql://...
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
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.config import TraceServerConfig  # noqa: E402
from app.db import migrate, search  # noqa: E402
from app.db.engine import create_engine  # noqa: E402
from app.db.models import (  # noqa: E402
    BATCHES,
    MEMBERS,
    PAYLOAD_COLUMNS,
    PAYLOADS,
    REVIEWS,
    TRACES,
)
from app.db.search import search_text  # noqa: E402
from app.domain import Trace  # noqa: E402

ENVS = ["swe-bench", "alfworld", "gaia", "tau-airline", "hotpotqa"]
MODELS = ["llama-4-maverick", "gpt-4o", "qwen3-32b", "hermes-3-70b"]
STAGES = [("rejected", 20), ("compressed", 10), ("compression_skipped", 15),
          ("below_threshold", 15), ("batched", 15), ("delivered", 25)]
STATUSES = [("success", 50), ("failure", 25), ("timeout", 10), ("error", 10), ("unknown", 5)]
FILTERS = ["repeated_thought", "empty_action", "tool_error_streak"]
REWARDS = [-30.0, -15.0, -5.0, 0.0, 5.0, 10.0, 15.0, 20.0, 30.0]
WORDS = ("the agent runs tests and reads the file then edits the function to fix the "
         "failing case while the observation shows a traceback from the compiler").split()
BATCH_SIZE = 32

# (label, path): the list's pages first; each must answer in under 300 ms.
PAGES = [
    ("newest", "/ui/traces"),
    ("oldest", "/ui/traces?sort=created_at"),
    ("reward, highest", "/ui/traces?sort=-reward"),
    ("tokens, fewest", "/ui/traces?sort=total_tokens"),
    ("status=timeout", "/ui/traces?status=timeout"),
    ("stage+env+model", "/ui/traces?stage=delivered&env=gaia&model=gpt-4o"),
    ("status, by reward", "/ui/traces?status=error&sort=-reward"),
    ("rejected_by", "/ui/traces?rejected_by=tool_error_streak"),
    ("label=good", "/ui/traces?label=good"),
    ("label=unreviewed", "/ui/traces?label=unreviewed&sort=-total_tokens"),
    ("search, common", "/ui/traces?q=traceback"),
    ("search, rare", "/ui/traces?q=needle-42"),
    ("search, none", "/ui/traces?q=nothing-matches-this"),
    ("min_reward+since", "/ui/traces?min_reward=20&since=2026-01-20T00:00:00Z"),
    ("200 a page", "/ui/traces?limit=200"),
]


def _pick(weighted: list[tuple[str, int]], rng: random.Random) -> str:
    return rng.choices([v for v, _ in weighted], [w for _, w in weighted])[0]


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def _trace(n: int, rng: random.Random, kb: int) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []
    budget = kb * 1000
    while budget > 0:
        content = _text(rng, rng.randint(80, 900))
        steps += [
            {"type": "thought", "content": content[:200]},
            {"type": "action", "tool": "terminal", "arguments": {"command": "pytest -x"},
             "call_id": f"c{len(steps)}"},
            {"type": "observation", "call_id": f"c{len(steps)}", "content": content,
             "exit_code": rng.choice([0, 0, 0, 1])},
        ]
        budget -= len(content) + 300
    final = _text(rng, 150) + (" needle-42" if n % 5000 == 0 else "")
    steps.append({"type": "final", "content": final})
    return {"trace_id": f"bench-{n:06d}", "task": f"Task {n}: " + _text(rng, 300),
            "steps": steps, "outcome": {"status": "success"}, "source_format": "native"}


def _row(n: int, start: datetime, rng: random.Random, kb: int) -> dict[str, Any]:
    stage = _pick(STAGES, rng)
    trace = _trace(n, rng, kb)
    reasons = ([{"filter": rng.choice(FILTERS), "detail": "bench", "step_index": 3}]
               if stage == "rejected" else [])
    compressed = stage in ("compressed", "batched", "delivered") and rng.random() < 0.5
    created = start + timedelta(seconds=n * 25)
    total = rng.randint(500, 50_000)
    return {
        "trace_id": trace["trace_id"], "created_at": created, "updated_at": created,
        "status": _pick(STATUSES, rng), "stage": stage, "total_tokens": total,
        "compressed_tokens": total // 4 if compressed else None,
        "reward": rng.choice(REWARDS),
        "reward_breakdown": {"task_success": {"fired": True, "count": 1, "points": 20.0}},
        "reject_reasons": reasons, "scored_with": "bench", "source_format": "native",
        "env": rng.choice(ENVS), "model": rng.choice(MODELS), "agent_name": "bench",
        "policy_version": f"v{rng.randint(1, 10)}", "content_hash": f"{n:064d}",
        "original": trace, "trace": trace,
        "compressed": trace if compressed else None,
        "compression": {"strategy": "bench", "ratio": 0.25} if compressed else None,
        "attempts": 0,
    }


async def fill(server: dict[str, Any], traces: int, kb: int) -> None:
    engine = create_engine(TraceServerConfig(**server))
    try:
        await migrate.upgrade(engine)
        async with engine.connect() as conn:
            if await conn.scalar(sa.select(sa.func.count()).select_from(TRACES)):
                print("the store is filled already: reusing it", file=sys.stderr)
                return
        rng = random.Random(7)
        start = datetime(2026, 1, 1, tzinfo=UTC)
        began = time.monotonic()
        batched: list[str] = []
        for first in range(0, traces, 1000):
            rows = [_row(n, start, rng, kb) for n in range(first, min(first + 1000, traces))]
            reviews = [{"trace_id": r["trace_id"], "label": rng.choice(["good", "bad"]),
                        "note": None, "reward": None, "reviewer": "bench",
                        "reviewed_at": r["created_at"]} for r in rows if rng.random() < 0.02]
            async with engine.begin() as conn:
                await conn.execute(sa.insert(TRACES), [
                    {k: v for k, v in r.items() if k not in PAYLOAD_COLUMNS} for r in rows])
                await conn.execute(sa.insert(PAYLOADS), [
                    {k: r[k] for k in ("trace_id", *PAYLOAD_COLUMNS)} for r in rows])
                # What the hub writes beside each trace it stores (app/db/search.py).
                texts = [(r["trace_id"], search_text(Trace.model_validate(r["trace"])))
                         for r in rows]
                await conn.run_sync(search.index, texts)
                if reviews:
                    await conn.execute(sa.insert(REVIEWS), reviews)
            batched += [r["trace_id"] for r in rows if r["stage"] in ("batched", "delivered")]
            print(f"\rfilled {first + len(rows)}/{traces} "
                  f"({time.monotonic() - began:.0f} s)", end="", file=sys.stderr)
        async with engine.begin() as conn:
            for i in range(0, len(batched) - BATCH_SIZE + 1, BATCH_SIZE):
                batch_id = f"b-bench-{i // BATCH_SIZE:05d}"
                now = start + timedelta(seconds=i)
                await conn.execute(sa.insert(BATCHES).values(
                    batch_id=batch_id, created_at=now, updated_at=now, size=BATCH_SIZE,
                    target="jsonl", format="sharegpt", state="delivered", attempts=1))
                await conn.execute(sa.insert(MEMBERS), [
                    {"trace_id": t, "batch_id": batch_id, "position": p}
                    for p, t in enumerate(batched[i:i + BATCH_SIZE])])
        print(file=sys.stderr)
    finally:
        await engine.dispose()


def start_hub(server: dict[str, Any], workdir: Path) -> tuple[subprocess.Popen[str], str]:
    config = workdir / "config.json"
    config.write_text(json.dumps({"trace_server": {**server, "host": "127.0.0.1", "port": 0}}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--config", str(config), "--no-workers"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if "listening on" in line:
            port = line.rsplit(":", 1)[1].strip()
            # Keep reading its log, so that a full pipe never stalls the hub.
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, f"http://127.0.0.1:{port}"
    raise SystemExit("the hub did not start")


def timed(client: httpx.Client, path: str, rounds: int) -> tuple[float, float, int]:
    """Median and p90 milliseconds of GET `path`, and how many rows the page shows."""
    first = client.get(path)
    first.raise_for_status()
    rows = first.text.count('<tr class="trace"')
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        client.get(path).raise_for_status()
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times), statistics.quantiles(times, n=10)[8], rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=int, default=100_000)
    parser.add_argument("--trace-kb", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--db", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--db-path", help="SQLite file to fill, or reuse when filled")
    parser.add_argument("--database-url", default=os.environ.get("ATROPOS_TEST_DATABASE_URL"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if args.db == "postgresql":
            if not args.database_url:
                raise SystemExit("--db postgresql needs --database-url")
            server: dict[str, Any] = {"storage_backend": "postgresql",
                                      "database_url": args.database_url}
        else:
            server = {"storage_backend": "sqlite",
                      "db_path": args.db_path or str(workdir / "dashboard.db")}
        asyncio.run(fill(server, args.traces, args.trace_kb))
        proc, url = start_hub(server, workdir)
        try:
            with httpx.Client(base_url=url, timeout=120) as client:
                for _, path in PAGES:  # a first pass reads the store into the page cache
                    client.get(path).raise_for_status()
                results = {label: timed(client, path, args.rounds) for label, path in PAGES}
                deep = client.get("/ui/traces").text
                cursor = deep.split('rel="next" href="', 1)[1].split('"', 1)[0]
                for _ in range(20):  # 20 pages in: a cursor costs what the first page does
                    page = client.get(cursor.replace("&amp;", "&")).text
                    cursor = page.split('rel="next" href="', 1)[1].split('"', 1)[0]
                results["page 21 by cursor"] = timed(client, cursor.replace("&amp;", "&"),
                                                     args.rounds)
                trace = f"/ui/traces/bench-{args.traces // 2:06d}"
                others = {"overview": timed(client, "/ui", 3),
                          "a trace's page": timed(client, trace, args.rounds)}
        finally:
            proc.terminate()
            proc.wait(30)

    load = ", ".join(f"{n:.1f}" for n in os.getloadavg())
    print(f"dashboard: {args.db}, {args.traces} traces of ~{args.trace_kb} KB, "
          f"{args.rounds} rounds, one request at a time; load average {load} "
          f"on {os.cpu_count()} CPUs")
    for label, (median, p90, rows) in results.items():
        verdict = "ok" if p90 < 300 else "OVER 300 ms"
        print(f"  /ui/traces {label:20} {rows:4} rows  median {median:7.1f} ms  "
              f"p90 {p90:7.1f} ms  {verdict}")
    for label, (median, p90, _) in others.items():
        print(f"  {label:31}            median {median:7.1f} ms  p90 {p90:7.1f} ms")
    print("reproduce: python bench/dashboard.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
