"""compress(): one trace in, `Compressed` or `Skipped` out. Pure: no database, no
stage moves; the only I/O is summarize_middle's model call.

Rules (DESIGN §6): target = clamp(ratio x total_tokens, min_tokens_after,
max_tokens_after). A trace with ratio x total_tokens < min_tokens_after is kept whole,
unless `forced` (compression disabled but the trace is over max_trace_tokens): then it
is compressed toward min_tokens_after. The result lands within 25% of the target
unless what is kept (every call and its result, every user turn, the system prompt)
is larger: then it stays over the target, with the ratio it reached in its record. It
is never under min_tokens_after; over max_tokens_after it is marked `over_limit`. A
result that saves less than `min_saving` of the trace's tokens is not worth the copy:
the trace is kept whole (Skipped, kind "min_saving").

Every result is checked against the invariants (app.compression.invariants) before it
is returned; one that breaks them is not returned: the trace is kept whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from app.compression.extract import key_decision_extract
from app.compression.invariants import violations
from app.compression.ledger import Budget, Ledger
from app.compression.summarize import Summarizer, summarize_middle
from app.config import CompressionConfig
from app.domain import Trace
from app.llm import LLMError
from app.tokens import count_parts

# How far a drop may overshoot under the aim; trims are sized to land on it.
_DROP_OVERSHOOT = 0.15


@dataclass(frozen=True)
class Skipped:
    """The trace stays whole; `reason` is what the log line says, `kind` the short
    name the periodic summary counts it under (SKIP_KINDS)."""

    reason: str
    kind: str = "other"


# Why traces are kept whole, as the periodic summary names them.
SKIP_KINDS = ("disabled", "small", "within_target", "min_saving", "unsafe")


@dataclass(frozen=True)
class Compressed:
    """A compressed copy of the trace (marked `sft_only`), and how it came about.

    `strategy` is the one that produced the trace; `fallback` says why it is not the
    configured one (summarize_middle fell back to key_decision_extract), and
    `model_failed` whether that was because the model failed. `removed` counts the
    steps affected per kind of removal; `removed_steps` lists them, as indices into
    the original trace's steps.
    """

    trace: Trace
    tokens_before: int
    tokens_after: int
    target: int
    strategy: str
    removed: dict[str, int] = field(default_factory=dict)
    removed_steps: dict[str, list[int]] = field(default_factory=dict)
    over_limit: bool = False
    fallback: str | None = None
    model_failed: bool = False

    @property
    def ratio(self) -> float:
        return round(self.tokens_after / self.tokens_before, 4) if self.tokens_before else 1.0

    def record(self) -> dict[str, Any]:
        """The compression fields of a trace record (JSON-ready)."""
        return {
            "strategy": self.strategy,
            "tokens_before": self.tokens_before,
            "tokens_after": self.tokens_after,
            "target": self.target,
            "ratio": self.ratio,
            "removed": self.removed,
            "removed_steps": self.removed_steps,
            "over_limit": self.over_limit,
            "fallback": self.fallback,
        }


async def compress(
    trace: Trace,
    total_tokens: int,
    policy: CompressionConfig,
    *,
    forced: bool = False,
    summarizer: Summarizer | None = None,
    fall_back: bool = True,
    reward: float | None = None,
    breakdown: dict[str, Any] | None = None,
) -> Compressed | Skipped:
    """Compress `trace` (whose `total_tokens` the caller counted at ingest) by `policy`.

    `forced`: the trace is over max_trace_tokens, so it is compressed even with
    `enabled: false` or a ratio x total under min_tokens_after. `summarizer` writes
    summarize_middle's summary (app.compression.ModelSummarizer in production); without
    one, that strategy falls back to key_decision_extract. When the summarizer fails
    (app.llm.LLMError), so does the strategy, unless `fall_back`. `reward` and
    `breakdown` are kept in the compressed trace's metadata when reward_signal is
    preserved.
    """
    target = compression_target(total_tokens, policy, forced)
    if isinstance(target, Skipped):
        return target
    budget = _budget(target, policy)
    ledger = Ledger.of(trace)
    links = ledger.links  # the original's
    strategy, fallback, model_failed = policy.strategy, None, False
    summarized: Ledger | None = None
    if policy.strategy == "summarize_middle":
        try:
            outcome = await summarize_middle(ledger, policy, budget, summarizer)
        except LLMError as exc:
            # A failed call, and a summary that is empty or makes the trace no
            # shorter (SummaryRefused): whether to retry is the caller's.
            if not fall_back:
                raise
            outcome, model_failed = f"the summary model failed: {exc}", True
        if isinstance(outcome, str):
            strategy, fallback = "key_decision_extract", outcome
        else:
            summarized = outcome
    if summarized is None:
        key_decision_extract(ledger, policy, budget)
    else:
        # The summary is all summarize_middle changes: the rest stays as it was.
        ledger = summarized
    compressed = ledger.result()
    tokens_after = count_parts(compressed.text_parts())
    if tokens_after < policy.min_tokens_after:
        # The floor has slack, so this is not expected; if it happens, keep the whole.
        return Skipped(
            f"compressed trace too short, min_tokens_after not satisfied "
            f"({tokens_after} < {policy.min_tokens_after}); kept whole", "small"
        )
    saving = 1 - tokens_after / total_tokens
    if saving < policy.min_saving:
        return Skipped(
            f"compression saves {saving:.1%} ({total_tokens} -> {tokens_after} tokens), "
            f"under compression.min_saving {policy.min_saving:.0%}; kept whole", "min_saving"
        )
    result = Compressed(
        trace=compressed,
        tokens_before=total_tokens,
        tokens_after=tokens_after,
        target=target,
        strategy=strategy,
        removed=dict(ledger.removed),
        removed_steps={kind: sorted(at) for kind, at in ledger.listed.items()},
        over_limit=tokens_after > policy.max_tokens_after,
        fallback=fallback,
        model_failed=model_failed,
    )
    result = _mark(result, policy, reward, breakdown)
    broken = violations(trace, result.trace, policy, links)
    if broken:
        # The strategies are built not to get here; if one does, nothing is lost.
        return Skipped(
            f"compression would break the trace ({'; '.join(broken[:3])}); kept whole", "unsafe"
        )
    return result


def compress_now(
    trace: Trace,
    total_tokens: int,
    policy: CompressionConfig,
    **options: Any,
) -> Compressed | Skipped:
    """`compress` run to its end in the caller, for a strategy that makes no model call
    (key_decision_extract): the same function the compression stage awaits, so the
    result is the same. Raises RuntimeError if it would wait on a model."""
    running = compress(trace, total_tokens, policy, **options)
    try:
        running.send(None)
    except StopIteration as done:
        result: Compressed | Skipped = done.value
        return result
    running.close()
    raise RuntimeError(f"compression by {policy.strategy} waits on a model call")


def smallest_compressed(policy: CompressionConfig, max_trace_tokens: int) -> int | None:
    """The fewest total_tokens of a trace that `policy` compresses (None: it compresses
    none). Bigger traces are compressed too, but for rounding near ratio 1: a hint for
    scheduling, not a rule."""
    def compressed(total: int) -> bool:
        return not isinstance(
            compression_target(total, policy, total > max_trace_tokens), Skipped
        )

    low, high = 1, 2**40
    if not compressed(high):
        return None
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if compressed(middle) else (middle + 1, high)
    return low


def compression_target(total: int, policy: CompressionConfig, forced: bool) -> int | Skipped:
    """The tokens a trace of `total` tokens is compressed toward, or why it is kept
    whole (DESIGN §6)."""
    if not policy.enabled and not forced:
        return Skipped("compression disabled (compression.enabled is false)", "disabled")
    wanted = policy.ratio * total
    if wanted < policy.min_tokens_after and not forced:
        return Skipped(
            f"ratio x total_tokens = {policy.ratio:g} x {total} = {wanted:.0f} "
            f"< min_tokens_after {policy.min_tokens_after}", "small"
        )
    target = min(max(round(wanted), policy.min_tokens_after), policy.max_tokens_after)
    if total <= target:
        return Skipped(f"total_tokens {total} already within the target {target}",
                       "within_target")
    return target


def _budget(target: int, policy: CompressionConfig) -> Budget:
    # Step counts add up to within a few tokens of the joined trace's count; the slack
    # keeps a result aimed at min_tokens_after from landing a token under it.
    slack = max(16, policy.min_tokens_after // 50) if policy.min_tokens_after else 0
    floor = policy.min_tokens_after + slack
    aim = max(target, floor)
    return Budget(aim=aim, floor=floor, lower=max(floor, int(aim * (1 - _DROP_OVERSHOOT))))


def _mark(
    result: Compressed,
    policy: CompressionConfig,
    reward: float | None,
    breakdown: dict[str, Any] | None,
) -> Compressed:
    """Mark the trace SFT-only (its tokens are no longer the policy's own, so RL
    consumers get the original) and record how it was compressed."""
    metadata = {**result.trace.metadata, "sft_only": True, "compression": result.record()}
    if "reward_signal" in policy.preserve_fields:
        if reward is not None:
            metadata["reward"] = reward
        if breakdown is not None:
            metadata["reward_breakdown"] = breakdown
    return replace(result, trace=result.trace.model_copy(update={"metadata": metadata}))
