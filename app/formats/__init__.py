"""Trace formats accepted at /v1/traces (DESIGN §4) and the exports back out of the
canonical trace.

    parse(item, fmt=None) -> Trace      any accepted format -> canonical
    detect(item) -> str                 which format an item is in
    export(trace, fmt) -> dict          canonical -> any of EXPORTS (openai, messages, ...)

The format is chosen by, in order: the item's own top-level "format" key (so each
item of a batch may name its own), the `fmt` argument (e.g. a request-wide choice),
and detection. Detection asks the registered formats in order (ATIF before native,
since both have `steps`); it only looks at which keys are present, so a malformed
item of a known shape gets that format's precise error rather than "unknown format".

A format is one module that declares a `FORMAT` record (app/formats/spec.py), plus
its line in REGISTERED below.

Every failure is an `app.errors.HubError`: `Invalid` (422) with the JSON path in
`field`, or `UnknownFormat` (400); `export` raises `Unexportable` for a trace the
format cannot hold (an OpenAI training record needs an assistant turn). The training
datasets built on these exports (parquet, DPO pairs) are in `dataset`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import orjson

from app.domain import Trace
from app.errors import BadRequest, Invalid, UnknownFormat
from app.formats import atif, gateway, native, openai, otlp, sharegpt
from app.formats._common import type_name
from app.formats.spec import Export, Format

__all__ = [
    "EXPORTS",
    "FORMATS",
    "REGISTERED",
    "STEP_LISTS",
    "TRAINING_EXPORTS",
    "Export",
    "Format",
    "detect",
    "export",
    "load",
    "parse",
    "sniff",
]

# The registration: in detection order.
REGISTERED: tuple[Format, ...] = (
    atif.FORMAT, openai.FORMAT, sharegpt.FORMAT, native.FORMAT, otlp.FORMAT, gateway.FORMAT
)

FORMATS: Mapping[str, Format] = MappingProxyType({f.name: f for f in REGISTERED})
EXPORTS: Mapping[str, Export] = MappingProxyType(
    {e.name: e for f in REGISTERED for e in f.exports}
)
# What distributor.format may name.
TRAINING_EXPORTS: tuple[str, ...] = tuple(name for name, e in EXPORTS.items() if e.training)
# Where the formats keep their steps, for app.ingest.limits.
STEP_LISTS: tuple[str, ...] = tuple(dict.fromkeys(k for f in REGISTERED for k in f.step_lists))

_ALIASES = {alias: f.name for f in REGISTERED for alias in f.aliases}
_PARSE_NAMES = ", ".join([*FORMATS, *_ALIASES])
_DETECTORS = [(f.name, f.looks_like) for f in REGISTERED if f.looks_like is not None]


def _detection_help() -> str:
    looked_for = [
        f"{f.detected_by} ({'/'.join([f.name, *f.aliases])})"
        for f in REGISTERED
        if f.looks_like is not None
    ]
    *first, last = looked_for
    keys = f"{', '.join(first)} or {last}" if first else last
    return (
        f"cannot tell the trace format: expected a {keys} key, "
        f'or name the format with "format": one of {_PARSE_NAMES}'
    )


_UNDETECTED = _detection_help()


def detect(item: dict[str, Any]) -> str:
    """The name of the format `item` is in; UnknownFormat when none fits."""
    name = sniff(item)
    if name is None:
        raise UnknownFormat(_UNDETECTED)
    return name


def sniff(item: dict[str, Any]) -> str | None:
    """The name of the format `item` looks like, or None."""
    return next((name for name, looks_like in _DETECTORS if looks_like(item)), None)


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
    """An item that travels as bytes: JSON text, unless the format `fmt` names reads
    bytes of its own (otlp: a protobuf request, as the assembly stage hands a trace over)."""
    reader = FORMATS[fmt].load if fmt is not None and fmt in FORMATS else None
    if reader is not None:
        return reader(raw)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the trace is not valid JSON: {exc}", code="malformed_json") from None


def export(trace: Trace, fmt: str) -> dict[str, Any]:
    """`trace` in the export format `fmt` (native, openai, messages, sharegpt, hermes, atif)."""
    return EXPORTS[_resolve(fmt, EXPORTS, {})].write(trace)


def _resolve(name: Any, known: Mapping[str, Any], aliases: Mapping[str, str]) -> str:
    if isinstance(name, str):
        key = name.strip().lower()
        key = aliases.get(key, key)
        if key in known:
            return key
    choices = ", ".join([*known, *aliases])
    raise UnknownFormat(f"unknown format {name!r}; one of {choices}"[:300], field="format")
