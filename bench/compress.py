"""key_decision_extract throughput on the real corpus, in input tokens/s on one core.

    python bench/compress.py [--rounds 5]

Corpus: the OpenHands multi_swe_bench runs and SWE-agent .traj files in
../shared/fixtures/real (loaded by tests/support/real_traces.py). Input tokens are each trace's
total_tokens, counted once beforehand as ingest does. The process is pinned to one CPU.
For comparison it also times the token counter alone on the same text, and compression of
~5 KB traces (the ingest benchmark's size) in traces/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.compression import Compressed, compress
from app.config import CompressionConfig
from app.domain import Trace
from app.tokens import count_parts
from tests.support.real_traces import OPENHANDS, SWE_AGENT, load

SMALL_BYTES = 5_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed passes over the corpus")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    policy = CompressionConfig()
    corpus = [(t, count_parts(t.text_parts())) for t in map(load, OPENHANDS + SWE_AGENT)]
    tokens = sum(n for _, n in corpus)
    print(f"corpus: {len(corpus)} real traces, {tokens} input tokens (cl100k_base)")

    tokenizer = _best(args.rounds, lambda: [count_parts(t.text_parts()) for t, _ in corpus])
    print(f"token counter alone, on the corpus: {tokens / tokenizer / 1e6:5.2f} M tokens/s")

    elapsed = _best(args.rounds, lambda: asyncio.run(_compress_all(corpus, policy)))
    print(
        f"key_decision_extract, end to end:      {tokens / elapsed / 1e6:5.2f} M input tokens/s"
        f"  ({elapsed * 1e3 / len(corpus):.1f} ms/trace, {tokenizer / elapsed:.2f}x the counter"
        " alone: the figure that holds when the machine is shared)"
    )

    results = asyncio.run(_compress_all(corpus, policy))
    done = [r for r in results if isinstance(r, Compressed)]
    ratios = [r.ratio for r in done]
    print(
        f"  compressed {len(done)}/{len(corpus)}, ratio median {statistics.median(ratios):.2f}, "
        f"over_limit {sum(r.over_limit for r in done)}"
    )

    small = [(t, count_parts(t.text_parts())) for t in (_prefix(t, SMALL_BYTES) for t, _ in corpus)]
    small_policy = CompressionConfig(min_tokens_after=100)  # so 5 KB traces are not skipped
    elapsed = _best(args.rounds, lambda: asyncio.run(_compress_all(small, small_policy)))
    print(
        f"~5 KB traces ({statistics.mean(n for _, n in small):.0f} tokens): "
        f"{len(small) / elapsed:,.0f} traces/s on one core"
    )
    print("reproduce: python bench/compress.py --rounds", args.rounds)


async def _compress_all(corpus: list[tuple[Trace, int]], policy: CompressionConfig) -> list[object]:
    return [await compress(trace, total, policy) for trace, total in corpus]


def _best(rounds: int, run: object) -> float:
    assert callable(run)
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def _prefix(trace: Trace, size: int) -> Trace:
    """The trace cut after the step that brings its JSON to `size` bytes."""
    steps, used = [], len(trace.task.encode())
    for step in trace.steps:
        steps.append(step)
        used += len(step.model_dump_json(exclude_none=True))
        if used >= size:
            break
    return trace.model_copy(update={"steps": steps, "task": trace.task[:1500]})


if __name__ == "__main__":
    main()
