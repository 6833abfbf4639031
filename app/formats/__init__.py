"""Trace formats accepted at /v1/traces (DESIGN §4) and the exports back out of the
canonical trace.

    parse(item, fmt=None) -> Trace      any accepted format -> canonical
    detect(item) -> str                 which format an item is in
    export(trace, fmt) -> dict          canonical -> native | openai | sharegpt | hermes | atif

The format is chosen by, in order: the item's own top-level "format" key (so each
item of a batch may name its own), the `fmt` argument (e.g. a request-wide choice),
and detection. Detection looks, in this order, for `schema_version` (atif),
`messages` (openai), `conversations` (sharegpt/Hermes), `steps` or `task` (native)
and `resourceSpans` (otlp: one trace's spans as OTLP/JSON); it only looks at which
keys are present, so a malformed item of a known shape gets that format's precise
error rather than "unknown format".

Every failure is an `app.errors.HubError`: `Invalid` (422) with the JSON path in
`field`, or `UnknownFormat` (400).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Protocol

import orjson

from app.domain import Trace
from app.errors import Invalid, UnknownFormat
from app.formats import atif, native, openai, otlp, sharegpt
from app.formats._common import type_name

__all__ = ["EXPORTS", "FORMATS", "Format", "detect", "export", "load", "parse"]


class Format(Protocol):
    NAME: str

    def looks_like(self, item: dict[str, Any]) -> bool: ...

    def parse(self, item: dict[str, Any]) -> Trace: ...


# Detection order: ATIF before native, since both have `steps`.
FORMATS: Mapping[str, Format] = MappingProxyType(
    {"atif": atif, "openai": openai, "sharegpt": sharegpt, "native": native, "otlp": otlp}
)
_ALIASES = {"hermes": "sharegpt"}
EXPORTS: Mapping[str, Callable[[Trace], dict[str, Any]]] = MappingProxyType(
    {
        "native": native.export,
        "openai": openai.export,
        "sharegpt": sharegpt.export,
        "hermes": sharegpt.export_hermes,
        "atif": atif.export,
    }
)
_PARSE_NAMES = ", ".join([*FORMATS, *_ALIASES])


def detect(item: dict[str, Any]) -> str:
    """The name of the format `item` is in; UnknownFormat when none fits."""
    for name, fmt in FORMATS.items():
        if fmt.looks_like(item):
            return name
    raise UnknownFormat(
        "cannot tell the trace format: expected a 'schema_version' (atif), 'messages' "
        "(openai), 'conversations' (sharegpt/hermes), 'steps' and 'task' (native) or "
        "'resourceSpans' (otlp) key, "
        f'or name the format with "format": one of {_PARSE_NAMES}'
    )


def parse(item: Any, fmt: str | None = None) -> Trace:
    """One item of a request, in any accepted format, as a canonical trace."""
    if not isinstance(item, dict):
        raise Invalid(f"a trace must be a JSON object, not {type_name(item)}")
    named = item.get("format")
    if named is None:
        named = fmt
    name = detect(item) if named is None else _resolve(named, FORMATS, _ALIASES)
    return FORMATS[name].parse(item)


def load(raw: bytes, fmt: str | None) -> Any:
    """An item that travels as bytes: an OTLP protobuf request when `fmt` is otlp (how
    the assembly stage hands over a trace's spans), else JSON text."""
    if fmt == otlp.NAME:
        return otlp.load(raw)
    return orjson.loads(raw)


def export(trace: Trace, fmt: str) -> dict[str, Any]:
    """`trace` in the export format `fmt` (native, openai, sharegpt, hermes, atif)."""
    return EXPORTS[_resolve(fmt, EXPORTS, {})](trace)


def _resolve(name: Any, known: Mapping[str, Any], aliases: Mapping[str, str]) -> str:
    if isinstance(name, str):
        key = name.strip().lower()
        key = aliases.get(key, key)
        if key in known:
            return key
    choices = ", ".join([*known, *aliases])
    raise UnknownFormat(f"unknown format {name!r}; one of {choices}"[:300], field="format")
