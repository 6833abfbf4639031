"""key_decision_extract throughput on the real corpus, in input tokens/s on one core.

    python bench/compress.py [--rounds 5]
    python bench/compress.py --quality [--show tau-bench/gpt-4o-airline.json#3 ...]
    python bench/compress.py --quality --db traces.db [--show TRACE_ID ...]

--quality prints instead what compression keeps on the whole real corpus with the
repo's example configs (tests/support/compression_quality.py): traces compressed and
skipped (by reason), tool calls and user turns kept, backed facts still backed, the
saving; --show prints the steps of the named traces before and after. With --db, the
same figures of what a hub (of any version) stored in that SQLite file: import the
corpus with the example configs, `atropos worker --burst`, then measure its database.

Corpus: the OpenHands multi_swe_bench runs and SWE-agent .traj files in
../shared/fixtures/real (loaded by tests/support/real_traces.py). Input tokens are each trace's
total_tokens, counted once beforehand as ingest does. The process is pinned to one CPU.
For comparison it also times the token counter alone on the same text, compression of
~5 KB traces (the ingest benchmark's size) in traces/s, and of bench/ingest.py's 50 KB
trace (which the default hub compresses as it ingests it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app import formats
from app.compression import Compressed, compress
from app.config import CompressionConfig
from app.domain import StepType, Trace
from app.tokens import count_parts
from bench.ingest import make_trace
from tests.support import compression_quality as quality
from tests.support.real_traces import OPENHANDS, SWE_AGENT, load

SMALL_BYTES = 5_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed passes over the corpus")
    parser.add_argument("--quality", action="store_true", help="what compression keeps")
    parser.add_argument("--show", nargs="*", default=[], help="traces to show, by location")
    parser.add_argument("--db", type=Path, help="with --quality: a hub's SQLite file to measure")
    args = parser.parse_args()
    if args.quality and args.db:
        _stored_quality(args.db, args.show)
        return
    if args.quality:
        asyncio.run(_quality(args.show))
        return
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

    # What compressing costs each 50 KB trace of bench/ingest.py --trace-kb 50, which the
    # default hub compresses in its ingest processes.
    ingest_trace = formats.parse(json.loads(json.dumps(make_trace(50)).replace("__ID__", "b")),
                                 None)
    large = [(ingest_trace, count_parts(ingest_trace.text_parts()))] * 20
    elapsed = _best(args.rounds, lambda: asyncio.run(_compress_all(large, policy)))
    print(f"bench/ingest.py's 50 KB trace ({large[0][1]} tokens, {len(ingest_trace.steps)} "
          f"steps): {elapsed * 1e3 / len(large):.2f} ms a trace")
    print("reproduce: python bench/compress.py --rounds", args.rounds)


async def _quality(show: list[str]) -> None:
    traces = quality.corpus()
    if not traces:
        sys.exit(f"no real traces at {quality.REAL}: the figures need the corpus")
    figures = await quality.measure(traces)
    _print(figures)
    worst = sorted(figures.checks, key=lambda c: c.facts_backed - c.facts)[:3]
    for c in worst:
        print(f"  least backed: {c.location}: {c.facts_backed}/{c.facts}")
    policy, max_trace_tokens = quality.example_policy()
    for location, trace in traces:
        if not any(location.endswith(name) for name in show):
            continue
        total = count_parts(trace.text_parts())
        result = await compress(trace, total, policy, forced=total > max_trace_tokens)
        print(f"\n== {location}: {total} tokens ->", getattr(result, "tokens_after", result))
        print("before:", _steps(trace))
        if isinstance(result, Compressed):
            print("after: ", _steps(result.trace))
            print("record:", {k: v for k, v in result.record().items() if k != "removed_steps"})


def _stored_quality(db: Path, show: list[str]) -> None:
    if not db.is_file():
        sys.exit(f"no database at {db}")
    figures, pairs = quality.stored(db)
    print(f"{db}: what its compression stage stored")
    _print(figures)
    for trace_id, (before, after) in pairs.items():
        if any(trace_id.startswith(prefix) for prefix in show):
            [c] = [c for c in figures.checks if c.location == trace_id]
            print(f"\n== {trace_id}: {c.tokens_before} -> {c.tokens_after} tokens; calls "
                  f"{c.calls_before} -> {c.calls_after}, user turns kept {c.users_kept}/"
                  f"{c.users}, backed facts {c.facts_backed}/{c.facts}")
            print("before:", _steps(before))
            print("after: ", _steps(after))
    print("reproduce: python bench/compress.py --quality --db", db)


def _print(figures: quality.Figures) -> None:
    for what, value in figures.summary().items():
        print(f"{what:>22}: {value}")
    print(f"{'skipped by reason':>22}: {dict(sorted(figures.skipped.items()))}")


def _steps(trace: Trace) -> str:
    """One letter per step: S system, U user, A assistant message, T thought, C call
    (with its tool), R result (e: elided, r: a reference), F final, Σ summary."""
    out = []
    for step in trace.steps:
        content = step.content or ""
        if step.type is StepType.ACTION:
            out.append(f"C:{step.tool}")
        elif step.type is StepType.OBSERVATION:
            out.append("Re" if "output elided" in content or "tokens cut" in content
                       else "Rr" if content.startswith("[output ") else "R")
        elif step.type is StepType.THOUGHT:
            out.append("T")
        elif step.type is StepType.FINAL:
            out.append("F")
        elif content.startswith("[CONTEXT SUMMARY]"):
            out.append("Σ")
        else:
            out.append({"system": "S", "assistant": "A"}.get(step.role or "", "U"))
    return " ".join(out)


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
