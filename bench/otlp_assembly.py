"""OTLP assembly on hostile input: how long `atropos serve` takes to answer about 1 MB
of spans built so that assembly does the most work per byte, beside the same
trajectory sent the way instrumentations usually send it (tests/support/otlp.py
`megabyte`).

    python bench/otlp_assembly.py               # SQLite, 5 rounds of each
    python bench/otlp_assembly.py --rounds 10

calls: 3,300 model-call spans, each saying one more message (each is merged into the
conversation so far), against one call saying it all beside as many spans without
messages. runs: 2,200 tool runs without their call id (each looks for its call),
against their results in the conversation beside as many plain spans.

Each body is posted to /v1/traces (OTLP/JSON in the hub's {"traces": [...]}: the ingest
processes assemble it) and timed from send to answer; the ratio hostile / usual is
the figure to watch (assembly that rescanned the conversation per span made it grow
with the input). The hub is warmed up first (its ingest processes started).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.hubs import write_config  # noqa: E402
from tests.support.otlp import QUIET, document, megabyte, trace_id, weather_run  # noqa: E402
from tests.support.processes import HubProcess  # noqa: E402

KINDS = ("calls", "runs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="posts of each body")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        config = write_config(Path(directory), {"db_path": f"{directory}/hub.db"}, otlp=QUIET)
        hub = HubProcess(config, "--no-workers").start()
        try:
            with hub.client() as client:
                warm = client.post("/v1/traces",
                                   json={"traces": [document(weather_run(trace_id()))]})
                assert warm.status_code == 207, warm.text
                print(f"python bench/otlp_assembly.py --rounds {args.rounds}")
                print(f"{'kind':<6} {'usual s':>9} {'hostile s':>10} {'ratio':>6}  (median)")
                for kind in KINDS:
                    took: dict[bool, list[float]] = {False: [], True: []}
                    for _ in range(args.rounds):
                        for hostile in (False, True):
                            body = orjson.dumps({"traces": [megabyte(kind, hostile)]})
                            started = time.perf_counter()
                            r = client.post("/v1/traces", content=body, timeout=120,
                                            headers={"content-type": "application/json"})
                            took[hostile].append(time.perf_counter() - started)
                            assert r.status_code == 207, r.text[:300]
                            assert "error" not in r.json()["results"][0], r.text[:300]
                    usual, hostile_s = (statistics.median(took[h]) for h in (False, True))
                    print(f"{kind:<6} {usual:>9.3f} {hostile_s:>10.3f} "
                          f"{hostile_s / usual:>6.2f}")
        finally:
            hub.stop()


if __name__ == "__main__":
    main()
