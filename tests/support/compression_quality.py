"""What training needs a compressed trace to keep, measured on the whole real corpus
with the repo's example configs: for the corpus tests (tests/test_compression_quality.py)
and the figures of `python bench/compress.py --quality`.

    figures = await measure(corpus())    # Figures: per-trace checks and corpus totals
    figures, traces = stored(Path("traces.db"))  # what a hub's compression stage stored
"""

from __future__ import annotations

import json
import sqlite3
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from app.compression import Compressed, Skipped, compress
from app.compression.facts import facts, step_text
from app.compression.ledger import speaker
from app.config import CompressionConfig, load_compression, load_config
from app.domain import Step, StepType, Trace
from app.import_sources import Parsed, read_path
from app.tokens import count_parts
from tests.support import REAL, ROOT

EXAMPLE_COMPRESSION = ROOT / "compression.json.example"
EXAMPLE_CONFIG = ROOT / "config.json.example"


def example_policy() -> tuple[CompressionConfig, int]:
    """The compression policy and max_trace_tokens of the repo's example configs."""
    return (load_compression(EXAMPLE_COMPRESSION).compression,
            load_config(EXAMPLE_CONFIG).trace_server.max_trace_tokens)


def corpus(root: Path = REAL) -> list[tuple[str, Trace]]:
    """Every trajectory of the real corpus, as `atropos import` reads it."""
    return [(r.location, r.trace) for r in read_path(root) if isinstance(r, Parsed)]


def calls(trace: Trace) -> list[tuple[str | None, str]]:
    """Each tool call as (tool, arguments), in order."""
    return [(s.tool, json.dumps(s.arguments, sort_keys=True))
            for s in trace.steps if s.type is StepType.ACTION]


def user_turns(trace: Trace) -> list[Step]:
    return [s for s in trace.steps if s.type is StepType.MESSAGE and speaker(s) == "user"
            and not (s.content or "").startswith("[CONTEXT SUMMARY]:")]


def kept_in_order(wanted: list[Step], steps: list[Step]) -> int:
    """How many of `wanted` appear unchanged in `steps`, in order."""
    it = iter(steps)
    return sum(1 for step in wanted if any(step == s for s in it))


def backed_facts(trace: Trace) -> list[tuple[int, str]]:
    """(step index, fact) for each fact an assistant step states that an earlier turn
    other than the assistant's holds."""
    held = facts(trace.task or "")
    found: list[tuple[int, str]] = []
    for i, step in enumerate(trace.steps):
        text = step_text(step)
        if speaker(step) == "assistant":
            found += [(i, f) for f in sorted(facts(text, parts=False) & held)]
        else:
            held |= facts(text)
    return found


def still_backed(original: Trace, compressed: Trace) -> tuple[int, int]:
    """(backed facts of the original that the compressed trace states, how many of
    those it still backs). A fact of a dropped assistant step is not stated, so not
    counted; the compressed step a fact belongs to is the same step, kept."""
    wanted: dict[int, set[str]] = {}
    for i, fact in backed_facts(original):
        wanted.setdefault(i, set()).add(fact)
    origin = _origins(original, compressed)
    held = facts(compressed.task or "")
    total = kept = 0
    for j, step in enumerate(compressed.steps):
        if speaker(step) != "assistant":
            held |= facts(step_text(step))
            continue
        source = origin.get(j)
        if source is None:
            continue
        mine = wanted.get(source, set()) & facts(step_text(step), parts=False)
        total += len(mine)
        kept += len(mine & held)
    return total, kept


def _origins(original: Trace, compressed: Trace) -> dict[int, int]:
    """Compressed step -> original step, for the assistant steps (never rewritten but
    for a thought's content, which is then not matched)."""
    out: dict[int, int] = {}
    start = 0
    for j, step in enumerate(compressed.steps):
        if speaker(step) != "assistant":
            continue
        for i in range(start, len(original.steps)):
            if original.steps[i] == step:
                out[j], start = i, i + 1
                break
    return out


@dataclass
class TraceCheck:
    location: str
    tokens_before: int
    tokens_after: int
    strategy: str
    calls_before: int
    distinct_calls: int
    distinct_kept: int
    calls_after: int
    users: int
    users_kept: int
    facts: int
    facts_backed: int

    @property
    def saving(self) -> float:
        return 1 - self.tokens_after / self.tokens_before

    @property
    def lost_every_call(self) -> bool:
        return self.calls_before > 0 and self.calls_after == 0


@dataclass
class Figures:
    checks: list[TraceCheck] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # reason kind -> traces

    def summary(self) -> dict[str, float | int]:
        c = self.checks
        distinct = sum(x.distinct_calls for x in c)
        users = sum(x.users for x in c)
        backed = sum(x.facts for x in c)
        return {
            "traces": len(c) + sum(self.skipped.values()),
            "compressed": len(c),
            "skipped": sum(self.skipped.values()),
            "lost_every_call": sum(x.lost_every_call for x in c),
            "lost_some_call": sum(x.distinct_kept < x.distinct_calls for x in c),
            "distinct_calls_kept": _share(sum(x.distinct_kept for x in c), distinct),
            "lost_a_user_turn": sum(x.users_kept < x.users for x in c),
            "user_turns_kept": _share(sum(x.users_kept for x in c), users),
            "facts_still_backed": _share(sum(x.facts_backed for x in c), backed),
            "unbacked_in": sum(x.facts_backed < x.facts for x in c),
            "mean_saving": round(statistics.mean(x.saving for x in c), 4) if c else 0.0,
            # Of all the compressed traces' tokens together.
            "tokens_saved": _share(sum(x.tokens_before - x.tokens_after for x in c),
                                   sum(x.tokens_before for x in c)),
            "min_saving": round(min((x.saving for x in c), default=0.0), 4),
        }


def _share(part: int, whole: int) -> float:
    return round(part / whole, 4) if whole else 1.0


def check(location: str, original: Trace, result: Compressed) -> TraceCheck:
    out = result.trace
    before, after = calls(original), calls(out)
    total, kept = still_backed(original, out)
    users = user_turns(original)
    return TraceCheck(
        location=location, tokens_before=result.tokens_before,
        tokens_after=result.tokens_after, strategy=result.strategy,
        calls_before=len(before), distinct_calls=len(set(before)),
        distinct_kept=len(set(before) & set(after)), calls_after=len(after),
        users=len(users), users_kept=kept_in_order(users, out.steps),
        facts=total, facts_backed=kept,
    )


async def measure(
    traces: Iterable[tuple[str, Trace]], policy: CompressionConfig | None = None,
    max_trace_tokens: int | None = None,
) -> Figures:
    if policy is None or max_trace_tokens is None:
        policy, max_trace_tokens = example_policy()
    figures = Figures()
    for location, trace in traces:
        total = count_parts(trace.text_parts())
        result = await compress(trace, total, policy, forced=total > max_trace_tokens)
        if isinstance(result, Skipped):
            kind = getattr(result, "kind", None) or result.reason.split(" ")[0]
            figures.skipped[kind] = figures.skipped.get(kind, 0) + 1
        else:
            figures.checks.append(check(location, trace, result))
    return figures


def stored(db: Path) -> tuple[Figures, dict[str, tuple[Trace, Trace]]]:
    """The figures of what a hub's compression stage stored in the SQLite file `db`
    (any version's: the payloads are read as traces, the record's skip reason as
    text), and each compressed trace as (original, compressed) by its trace id."""
    figures, pairs = Figures(), {}
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT trace_id, total_tokens, compressed_tokens, trace, "
                            "compressed, compression FROM traces "
                            "WHERE compression IS NOT NULL ORDER BY trace_id").fetchall()
    for trace_id, before, after, trace, compressed, compression in rows:
        record = json.loads(compression)
        if compressed is None:
            why = str(record.get("skipped", ""))
            kind = ("min_saving" if why.startswith("compression saves")
                    else "small" if why.startswith("ratio x") else why.split(" ")[0])
            figures.skipped[kind] = figures.skipped.get(kind, 0) + 1
            continue
        original = Trace.model_validate_json(trace)
        result = Compressed(trace=Trace.model_validate_json(compressed), tokens_before=before,
                            tokens_after=after, target=record.get("target", 0),
                            strategy=record.get("strategy", ""))
        figures.checks.append(check(trace_id, original, result))
        pairs[trace_id] = (original, result.trace)
    return figures, pairs
