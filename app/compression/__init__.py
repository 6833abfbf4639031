"""Compression: long traces cut to their training-worthy core.

    result = await compress(trace, total_tokens, policy, forced=..., summarizer=...)
    # -> Compressed(trace, tokens_before, tokens_after, target, ratio, strategy,
    #               removed, over_limit, fallback) | Skipped(reason)

Modules: `compress` (entry point, the target and min_saving rules), `extract`
(key_decision_extract and its passes), `summarize` (summarize_middle, Hermes'
algorithm), `ledger` (per-step token bookkeeping, elision, and the links a removal
must not break), `facts` (the identifiers and numbers a cut output must keep),
`invariants` (what every strategy keeps, checked on every result).
"""

from __future__ import annotations

from app.compression.compress import (
    Compressed,
    Skipped,
    compress,
    compress_now,
    compression_target,
    smallest_compressed,
)
from app.compression.summarize import ModelSummarizer, Summarizer

__all__ = [
    "Compressed",
    "ModelSummarizer",
    "Skipped",
    "Summarizer",
    "compress",
    "compress_now",
    "smallest_compressed",
    "compression_target",
]
