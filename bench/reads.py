"""Read benchmark: the answers of a real `atropos serve` that carry the most JSON, one
request at a time on 127.0.0.1: a page of 1,000 traces, one large trace (canonical and
original views) and /v1/stats; prints the median and p90 time of each. Since the /v1
reads return response models (app/api/schemas.py), pydantic validates and writes these
bodies; compare against a checkout without them by running the same script there.

    python bench/reads.py                         # 1,000 traces of ~5 KB, one of ~400 KB
    python bench/reads.py --big-kb 2000 --rounds 50
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.ingest import make_trace, start_hub  # noqa: E402


def timed(client: httpx.Client, path: str, rounds: int) -> tuple[float, float, int]:
    """Median and p90 milliseconds of GET `path`, and the body's size."""
    size = len(client.get(path).raise_for_status().content)  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        client.get(path).raise_for_status()
        times.append((time.perf_counter() - start) * 1000)
    deciles = statistics.quantiles(times, n=10)
    return statistics.median(times), deciles[8], size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=int, default=1000)
    parser.add_argument("--trace-kb", type=int, default=5)
    parser.add_argument("--big-kb", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        server = {"host": "127.0.0.1", "port": 0, "storage_backend": "sqlite",
                  "db_path": str(workdir / "bench.db")}
        limits = {"max_traces_per_request": 100, "max_body_bytes": 100_000_000}
        proc, port = start_hub({"trace_server": server, "limits": limits}, workdir,
                               workers=False)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                template = json.dumps(make_trace(args.trace_kb))
                for start in range(0, args.traces, 100):
                    batch = [json.loads(template.replace("__ID__", f"t{n}")) | {"trace_id": f"t{n}"}
                             for n in range(start, min(start + 100, args.traces))]
                    client.post("/v1/traces", json={"traces": batch}).raise_for_status()
                big = make_trace(args.big_kb) | {"trace_id": "big"}
                client.post("/v1/traces", json=big).raise_for_status()
                paths = [f"/v1/traces?limit={min(args.traces, 1000)}", "/v1/traces/big",
                         "/v1/traces/big?view=original", "/v1/stats"]
                results = {path: timed(client, path, args.rounds) for path in paths}
        finally:
            proc.terminate()
            proc.wait()

    print(f"reads: sqlite, {args.traces} traces of {args.trace_kb} KB and one of "
          f"{args.big_kb} KB, {args.rounds} rounds, one request at a time")
    for path, (median, p90, size) in results.items():
        print(f"  GET {path:32} {size / 1000:8.1f} KB  median {median:6.2f} ms  p90 {p90:6.2f} ms")
    print("reproduce: python bench/reads.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
