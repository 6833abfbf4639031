"""Secrets out of traces before they are stored: `Redactor.redact(value)` replaces each
secret in every string of a JSON value (keys too) with `[REDACTED:<kind>]` and counts
them by kind.

Two steps, both RE2 (linear time, whatever the input; docs/decisions.md, "Secrets
never at rest"):
- a pre-check: one pass over the value's JSON text for the cheap marks every secret
  carries (`sk-`, `AKIA`, `PRIVATE KEY`, `eyJ`, `://x:y@`, ...). Almost every trace
  has none and costs this pass only. Each mark survives JSON encoding (no quote,
  backslash or control character in it), so a secret in a string is never missed.
- on a hit, each string that holds a secret is rewritten by the kinds' own patterns,
  on the decoded text, where word boundaries and `^`/`$` mean what they say.

Traces are redacted before parsing, so the stored `original` and the canonical trace
agree, and the content hash (idempotency) is that of the redacted item.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import orjson
import re2  # type: ignore[import-untyped,import-not-found,unused-ignore]

from app.config import PrivacyConfig
from app.patterns import QUIET, compile_pattern

CUSTOM = "custom"


@dataclass(frozen=True, slots=True)
class _Kind:
    name: str
    # The secret; where it has a group 1, only that group is the secret (the context
    # around it, `Bearer `, `user:` ... `@`, stays).
    pattern: str
    # A necessary mark of it in JSON text, for the pre-check.
    mark: str


# Where a token starts: the text's start, a character that cannot be part of it, or a
# JSON escape (backslash-n): tool arguments are often JSON text, in which `\nsk-...` has no
# word boundary before the key. RE2 has no look-behind: the character is matched, and
# group 1 is the secret.
_START = r"(?:^|[^A-Za-z0-9_]|\\[nrtbf])"

# In priority order: a private key block holds text the later kinds would match, and
# `sk-ant-` is an Anthropic key before it is an OpenAI one.
_SECRETS = (
    _Kind(
        "private_key",
        # The whole block; a block cut short (an agent printed part of a file) up to
        # where its base64 lines end, their line breaks real or JSON escapes (a tool's
        # JSON output, as Hermes' <tool_response> holds it).
        r"-----BEGIN[A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----(?:[\s\S]*?-----END[A-Z0-9 ]*"
        r"PRIVATE KEY(?: BLOCK)?-----|(?:(?:\s|\\[nr])*(?:[A-Za-z0-9+/=]{16,}|"
        r"Proc-Type:[^\n\\]*|DEK-Info:[^\n\\]*))*)",
        r"PRIVATE KEY",
    ),
    _Kind(
        "url_password",
        # user:password@ (the user may be empty, `redis://:password@host`), the password
        # as people write it, unencoded: up to the last @ before a `/`, or holding `/`
        # but no `@`, unless it is a port and a path (`http://host:8080/path@x`).
        r"[A-Za-z][A-Za-z0-9+.-]*://[^\s/?#@:\"'<>\\]*:([^\s/?#\"'<>\\]+|[0-9]*"
        r"[^\s/?#@\"'<>\\0-9][^\s?#@\"'<>\\]*)@",
        r"://[^/\s\"]*:[^\s\"]*@",
    ),
    _Kind(
        "jwt",
        _START + r"(eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*)",
        r"eyJ",
    ),
    _Kind(
        "bearer_token",
        r"(?i:bearer)[ \t]+([A-Za-z0-9._~+/-]{16,}=*)",
        r"(?i:bearer)",
    ),
    _Kind("anthropic_api_key", _START + r"(sk-ant-[A-Za-z0-9_-]{20,})", r"sk-ant-"),
    _Kind(
        "openai_api_key", _START + r"(sk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,})", r"sk-"
    ),
    _Kind("google_api_key", _START + r"(AIza[0-9A-Za-z_-]{35})", r"AIza"),
    _Kind(
        "aws_access_key_id",
        _START + r"((?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16})\b",
        r"A(?:KI|SI|BI|CC)A",
    ),
    _Kind(
        "aws_secret_access_key",
        # Forty base64 characters are a secret only where they are named one:
        # `aws_secret_access_key = ...`, `"AWS_SECRET_ACCESS_KEY": "..."`.
        r"(?i:aws_?secret_?(?:access_?)?key|secret_?access_?key)(?:\\?[\"'])?\s*[:=]\s*"
        r"(?:\\?[\"'])?([A-Za-z0-9/+]{40})\b",
        r"(?i:secret_?(?:access_?)?key)",
    ),
    _Kind(
        "github_token",
        _START + r"(gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})",
        r"gh[pousr]_|github_pat_",
    ),
    _Kind(
        "slack_token",
        _START + r"(xox[abposr]-[A-Za-z0-9-]{10,}|xapp-[0-9]-[A-Za-z0-9-]{10,}|"
        r"https://hooks\.slack\.com/services/[A-Za-z0-9_/]+)",
        r"xox[abposr]-|xapp-|hooks\.slack\.com",
    ),
    _Kind("huggingface_token", _START + r"(hf_[A-Za-z0-9]{30,})", r"hf_"),
)
_EMAIL = _Kind("email", _START + r"([A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,})\b", r"@")
# A value under a key that names an AWS secret, in a JSON object rather than in text.
_AWS_SECRET_NAME = re2.compile(r"(?i)^(?:aws_?)?secret_?(?:access_?)?key$")
_AWS_SECRET_VALUE = re2.compile(r"^[A-Za-z0-9/+]{40}$")


# A JSON escape of a character a token may hold (ASCII 0x20-0x7f; JSON writers escape
# nothing there but `"` and `\`, as \" and \\), literal in a string: a secret may be
# spelt so. The pre-check's mark for it, and what `_text` decodes.
_ESCAPE_MARK = r"(?:\\u00[2-7][0-9A-Fa-f])"
_ESCAPED = re2.compile(r"\\u00([2-7][0-9A-Fa-f])")
_TOKEN_PUNCTUATION = frozenset("-_+/=.:@~")


def _unescaped(match: Any) -> str:
    char = chr(int(match.group(1), 16))
    # Only what may be part of a secret: a quote or backslash decoded would change
    # what the JSON around it means.
    return char if char.isalnum() or char in _TOKEN_PUNCTUATION else str(match.group(0))


REDACTED = "[REDACTED:"  # how every marker starts


def marker(kind: str) -> str:
    return f"{REDACTED}{kind}]"


@dataclass(frozen=True, slots=True)
class Redacted:
    """An item whose secrets were replaced before it came to be prepared (an OTLP
    trace: its spans were redacted as they were stored), and how many, by kind;
    `metadata`: what its trace's metadata says besides (spans left out of it)."""

    item: Any
    counts: dict[str, int]
    metadata: dict[str, Any] = field(default_factory=dict)


@lru_cache(maxsize=4)
def redactor_for(privacy: str) -> Redactor:
    """The privacy section (its JSON) compiled once per process, for work sent to the
    ingest processes: compiled RE2 patterns do not pickle."""
    return Redactor(PrivacyConfig.model_validate_json(privacy))


class Redactor:
    """The privacy section, compiled. Pickled (into the ingest processes) as its
    config: compiled RE2 patterns do not pickle."""

    def __init__(self, config: PrivacyConfig) -> None:
        self.config = config
        kinds = list(_SECRETS) if config.redact_secrets else []
        if config.redact_emails:
            kinds.append(_EMAIL)
        self._kinds = [(kind.name, re2.compile(kind.pattern)) for kind in kinds]
        self._kinds += [(CUSTOM, compile_pattern(p)) for p in config.extra_patterns]
        # Which kinds a string holds, in one pass: a set runs the DFA alone, without
        # the submatch search that one alternation of them all (with their groups)
        # falls back to, far slower (bench/redaction.py).
        self._any = re2.Set.SearchSet(QUIET) if self._kinds else None
        if self._any is not None:
            for kind in kinds:
                self._any.Add(kind.pattern)
            for pattern in config.extra_patterns:
                self._any.Add(pattern)
            self._any.Compile()
        # Custom patterns have no mark that surely survives JSON encoding (they may
        # use ^, $ or quotes): with any, every string is looked at.
        marks = "|".join(f"(?:{kind.mark})" for kind in kinds)
        if marks:
            marks += "|" + _ESCAPE_MARK
        self._marks = (
            re2.compile(marks.encode()) if marks and not config.extra_patterns else None
        )
        self._aws_by_name = config.redact_secrets
        # The shortest text a built-in kind matches (an email, a@b.cc); a custom
        # pattern may match anything.
        self._shortest = 0 if config.extra_patterns else 6

    def __reduce__(self) -> tuple[Any, ...]:
        return (Redactor, (self.config,))

    @property
    def enabled(self) -> bool:
        return self._any is not None

    def may_hold_secrets(self, encoded: bytes) -> bool:
        """The pre-check, on a value's JSON text: False means it holds no secret."""
        if self._any is None:
            return False
        return self._marks is None or self._marks.search(encoded) is not None

    def redact(self, value: Any, encoded: bytes | None = None) -> tuple[Any, dict[str, int]]:
        """The value with every secret replaced, and the replacements by kind. `encoded`:
        its JSON text, when the caller has it already (for the pre-check)."""
        if encoded is None and self._any is not None:
            encoded = orjson.dumps(value)
        if encoded is None or not self.may_hold_secrets(encoded):
            return value, {}
        counts: Counter[str] = Counter()
        return _walk(value, lambda text: self._text(text, counts), self._by_name(counts)), dict(
            counts
        )

    def redact_text(self, text: str) -> tuple[str, dict[str, int]]:
        counts: Counter[str] = Counter()
        return self._text(text, counts), dict(counts)

    def rewrite(self, text: str, counts: Counter[str], key: str | None = None) -> str:
        """One string with its secrets replaced, counted into `counts`; `key`: the name
        it is stored under, if any (a value named an AWS secret is one). For values
        walked by their owner (OTLP's protobuf spans), after `may_hold_secrets`."""
        if key is not None:
            named = self._by_name(counts)(key, text)
            if named is not None:
                return named
        return self._text(text, counts)

    def _text(self, text: str, counts: Counter[str]) -> str:
        # Keys and short values ("type", "role") hold no secret, and a Set.Match on each
        # would cost more than the rest of the walk (bench/redaction.py).
        if self._any is None or len(text) < self._shortest:
            return text
        if "\\u" in text:
            # JSON text in a string (a tool call's arguments) may spell a secret with
            # escapes, `\u0073k-...`, which the hub decodes when it reads the JSON: such
            # a string is looked at with its escaped token characters decoded, and
            # stored that way if it held a secret so spelt.
            plain = _ESCAPED.sub(_unescaped, text)
            if plain != text:
                found: Counter[str] = Counter()
                redacted = self._matched(plain, found)
                if found:
                    counts.update(found)
                    return redacted
        return self._matched(text, counts)

    def _matched(self, text: str, counts: Counter[str]) -> str:
        assert self._any is not None
        # In the kinds' order (Set.Match does not keep it): the priority above.
        for index in sorted(self._any.Match(text) or ()):
            name, pattern = self._kinds[index]
            text = pattern.sub(_replacer(name, pattern.groups, counts), text)
        return text

    def _by_name(self, counts: Counter[str]) -> Callable[[str, str], str | None]:
        def named(key: str, value: str) -> str | None:
            # Cheap tests first: most values are not 40 characters long.
            if (
                self._aws_by_name
                and len(value) == 40
                and "secret" in key.lower()
                and _AWS_SECRET_NAME.search(key) is not None
                and _AWS_SECRET_VALUE.search(value) is not None
            ):
                counts["aws_secret_access_key"] += 1
                return marker("aws_secret_access_key")
            return None

        return named


def _replacer(name: str, groups: int, counts: Counter[str]) -> Callable[[Any], str]:
    def replace(match: Any) -> str:
        counts[name] += 1
        whole: str = match.group(0)
        # A custom pattern's groups are its own business: the whole match goes.
        if name == CUSTOM or groups == 0 or match.group(1) is None:
            return marker(name)
        # Only the secret within its context: `Bearer [REDACTED:...]`.
        start, end = match.start(1) - match.start(0), match.end(1) - match.start(0)
        return whole[:start] + marker(name) + whole[end:]

    return replace


def _walk(
    value: Any, text: Callable[[str], str], named: Callable[[str, str], str | None]
) -> Any:
    if isinstance(value, str):
        return text(value)
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            new_key = text(key) if isinstance(key, str) else key
            if isinstance(item, str) and isinstance(key, str):
                by_name = named(key, item)
                out[new_key] = by_name if by_name is not None else text(item)
            else:
                out[new_key] = _walk(item, text, named)
        return out
    if isinstance(value, list):
        return [_walk(item, text, named) for item in value]
    return value
