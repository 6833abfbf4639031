"""The redaction patterns a config may add (privacy.extra_patterns): RE2, checked when
the config is loaded and compiled where traces are redacted (app/evaluation/redaction.py).
Below both, so that the config need not import the code that uses it."""

from __future__ import annotations

from typing import Any

import re2  # type: ignore[import-untyped,import-not-found,unused-ignore]

__all__ = ["QUIET", "compile_pattern"]

QUIET = re2.Options()
QUIET.log_errors = False  # a bad pattern is reported once, as a ConfigError


def compile_pattern(pattern: str) -> Any:
    """An RE2 pattern, or ValueError saying why it is not one (config validation)."""
    try:
        compiled = re2.compile(pattern, QUIET)
    except re2.error as exc:
        reason = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc
        raise ValueError(f"not a valid RE2 pattern ({reason})") from None
    if compiled.fullmatch("") is not None:
        raise ValueError(f"{pattern!r} matches the empty string, so it would redact nothing")
    return compiled
