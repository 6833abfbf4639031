"""Parsers on hostile input: how long `atropos serve` takes to answer about 1 MB of each
format's worst text for its parser (tags that never close, near-duplicate thoughts:
tests/support/hostile.py `adversarial`), beside 1 MB of prose in the same shape; and
how long the native parser alone takes on a 5 KB trace.

    python bench/formats_hostile.py               # SQLite, 5 rounds of each
    python bench/formats_hostile.py --rounds 10

Each body is posted to /v1/traces (the ingest processes parse, score and count its
tokens) and timed from send to answer; the ratio hostile / prose is the figure to
watch: a parser that rescans the text per tag makes it grow with the input (a 144 KB
ShareGPT turn of "<tool_call> " once took 49 s). The hub is warmed up first (its ingest
processes started, the tokenizer loaded). The parse figure is the median, over the
rounds, of the mean of 200 parses in this process.
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

from app import formats  # noqa: E402
from tests.support.hostile import (  # noqa: E402
    FORMATS,
    MB,
    adversarial,
    fill,
    five_kb_native,
    prose,
)
from tests.support.hubs import write_config  # noqa: E402
from tests.support.processes import HubProcess  # noqa: E402

PARSES = 200


def _parse_seconds(rounds: int) -> float:
    item = five_kb_native()
    formats.parse(item)
    took = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(PARSES):
            formats.parse(item)
        took.append((time.perf_counter() - started) / PARSES)
    return statistics.median(took)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="posts of each body")
    args = parser.parse_args()
    print(f"python bench/formats_hostile.py --rounds {args.rounds}")
    print(f"native parse, 5 KB trace: {_parse_seconds(args.rounds) * 1e6:.0f} µs (median)")
    with tempfile.TemporaryDirectory() as directory:
        config = write_config(Path(directory), {"db_path": f"{directory}/hub.db"},
                              limits={"max_step_chars": 2 * MB})
        hub = HubProcess(config, "--no-workers").start()
        try:
            with hub.client() as client:
                warm = client.post("/v1/traces", json=adversarial("openai", prose), timeout=120)
                assert warm.status_code == 202, warm.text[:300]
                print(f"{'format':<9} {'prose s':>8} {'hostile s':>10} {'ratio':>6}  (median)")
                for fmt in FORMATS:
                    took: dict[bool, list[float]] = {False: [], True: []}
                    for _ in range(args.rounds):
                        for hostile in (False, True):
                            body = orjson.dumps(adversarial(fmt, fill if hostile else prose))
                            started = time.perf_counter()
                            r = client.post("/v1/traces", content=body, timeout=120,
                                            headers={"content-type": "application/json"})
                            took[hostile].append(time.perf_counter() - started)
                            assert r.status_code == 202, (fmt, hostile, r.text[:300])
                    usual, hostile_s = (statistics.median(took[h]) for h in (False, True))
                    print(f"{fmt:<9} {usual:>8.3f} {hostile_s:>10.3f} {hostile_s / usual:>6.2f}")
        finally:
            hub.stop()


if __name__ == "__main__":
    main()
