"""The one token counter: every token count in the hub (total_tokens,
compressed_tokens, compression targets) goes through `count_tokens`/`count_parts`, so
the numbers are comparable.

The counts are cl100k_base's, as tiktoken's `encode_ordinary` makes them. toktok (a
BPE counter in Rust, its tables compiled in) counts them without building the tokens,
faster than tiktoken (docs/ingest.md) and with no tables to download; tests/test_tokens.py
checks that its counts equal tiktoken's on every text of the real corpus and on random
text. One known difference: toktok's Unicode tables know the 4,657 letters and digits
Unicode 17.0 added (2025: CJK Extension J, a few new scripts), tiktoken's do not, and
a text holding one can count a token more or less around it (docs/decisions.md).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from functools import cache
from typing import Protocol, cast

from app.errors import StartupError

# Agents resend the same long texts in every trace (a Hermes system prompt with its
# tool schemas is ~13k tokens): their counts are remembered, keyed by the text's hash.
LONG_PART_CHARS = 2048
_CACHE_SIZE = 4096
_long_counts: dict[int, int] = {}
_lock = threading.Lock()


class TokenCounter(Protocol):
    def count(self, text: str) -> int: ...


@cache
def encoding() -> TokenCounter:
    """cl100k_base, loaded once per process (the ingest processes' fork server loads it
    for all of them)."""
    try:
        return cast(TokenCounter, tokenizer_class()("cl100k_base", ""))
    except StartupError:
        raise
    except Exception as exc:  # an extension that does not load its tables
        raise _unusable(exc) from None


def tokenizer_class() -> type:
    """The tokenizer's class, imported (a few milliseconds; loading cl100k_base with
    `encoding` takes far longer): whether the tokenizer is usable, checked before a hub
    serves."""
    try:
        # The extension's own class: the package's `batch_count` wrapper costs more a
        # call than counting a typical trace's text (docs/ingest.md).
        from toktok._toktok import Tokenizer as Toktok
    except Exception as exc:  # an import error, or an extension that does not load
        raise _unusable(exc) from None
    return cast(type, Toktok)


def _unusable(exc: Exception) -> StartupError:
    return StartupError(
        f"The cl100k_base tokenizer could not be loaded ({type(exc).__name__}: {exc}): "
        "reinstall the toktok-rs package, which ships it."
    )


def count_tokens(text: str) -> int:
    # Ordinary text only: agent text may contain "<|endoftext|>" literally; it is text here.
    try:
        return encoding().count(text)
    except UnicodeEncodeError:
        # A lone surrogate (JSON read by the standard library can hold one): counted as
        # tiktoken counts it, as U+FFFD.
        return encoding().count(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"))


def count_parts(parts: Iterable[str]) -> int:
    """Tokens of the parts as a reader sees them: the short ones joined by newlines and
    counted at once, each long one on its own (and remembered)."""
    short: list[str] = []
    total = 0
    for part in parts:
        if len(part) < LONG_PART_CHARS:
            short.append(part)
        else:
            total += _count_long(part)
    return total + (count_tokens("\n".join(short)) if short else 0)


def _count_long(text: str) -> int:
    key = hash(text)
    count = _long_counts.get(key)
    if count is None:
        count = count_tokens(text)
        with _lock:
            if len(_long_counts) >= _CACHE_SIZE:
                _long_counts.clear()  # crude, bounded; the common prompts come back at once
            _long_counts[key] = count
    return count
