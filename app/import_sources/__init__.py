"""Reading trajectory files written by other agent frameworks, for `atropos import`.

    for record in read_path(Path("runs/"), fmt="auto"):
        match record:
            case Parsed(trace, location): ...
            case Unreadable(location, reason): ...

Files: `.jsonl`/`.ndjson` are read line by line (a bad line is Unreadable and reading
goes on); `.json` and `.traj` are one JSON document, an object or a list (a list no
adapter takes whole is a list of records); anything else is text (Reflexion logs). A
directory is read file by file, in name order. Locations are `file:line` for JSONL,
`file#index` for list items (a tau-bench file), with `#n` added when one record holds
several trajectories (an Atropos group's rollouts, a Reflexion log).

The format is detected per record from its content (its keys), never from the file
name; `fmt` names an adapter to skip detection. Each source format is one module
with `NAME`, `looks_like(obj)` and `parse(obj) -> Iterator[Trace]`; the generic
formats go to app.formats (see `generic`). A trace without a `trace_id` gets one
derived from its content, so importing the same file twice stores nothing twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from app.domain import Trace
from app.errors import HubError
from app.import_sources import (
    agentbench,
    atropos_group,
    fireact,
    knowagent,
    mini_swe_agent,
    openhands,
    reflexion,
    smolagents,
    swe_agent,
    tau_bench,
    toolbench,
)
from app.import_sources._common import Adapter, Unusable, stable_id
from app.import_sources.generic import FORMATS, Delegate

__all__ = ["ADAPTERS", "Parsed", "Record", "Unreadable", "detect", "formats", "read_path"]


@dataclass(frozen=True, slots=True)
class Parsed:
    trace: Trace
    location: str


@dataclass(frozen=True, slots=True)
class Unreadable:
    location: str
    reason: str


Record = Parsed | Unreadable

# Detection order: the specific sources first, since several of them are also chat
# messages underneath; the generic formats last.
ADAPTERS: tuple[Adapter, ...] = (
    tau_bench,
    toolbench,
    swe_agent,
    mini_swe_agent,
    openhands,
    smolagents,
    agentbench,
    knowagent,
    atropos_group,
    fireact,
    reflexion,
    Delegate(),
)

_LINES = frozenset({".jsonl", ".ndjson"})
_DOCUMENTS = frozenset({".json", ".traj"})
_TEXT = frozenset({".txt", ".log"})
# What a broken record can raise while an adapter reads it; anything else is a bug.
_RECORD_ERRORS = (Unusable, HubError, KeyError, TypeError, ValueError, AttributeError, IndexError)

Pick = Callable[[Any], Adapter | None]


def formats() -> list[str]:
    """The names `fmt` accepts."""
    return ["auto", *(adapter.NAME for adapter in ADAPTERS[:-1]), *FORMATS]


def detect(obj: Any) -> Adapter | None:
    """The first adapter that recognises `obj`, or None."""
    return next((adapter for adapter in ADAPTERS if adapter.looks_like(obj)), None)


def read_path(path: Path, fmt: str = "auto") -> Iterator[Record]:
    """Every trajectory in `path` (a file or a directory), each Parsed or Unreadable.

    Raises ValueError at once for an unknown `fmt`; never for a bad record.
    """
    return _read(path, _picker(fmt))


def _picker(fmt: str) -> Pick:
    if fmt == "auto":
        return detect
    if fmt in FORMATS:
        delegate = Delegate(fmt)
        return lambda _obj: delegate
    named = {adapter.NAME: adapter for adapter in ADAPTERS[:-1]}
    if fmt not in named:
        raise ValueError(f"unknown format {fmt!r}; use one of: {', '.join(formats())}")
    return lambda _obj: named[fmt]


def _read(path: Path, pick: Pick) -> Iterator[Record]:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir() and file.suffix not in _LINES | _DOCUMENTS | _TEXT:
            continue  # READMEs and the like beside the data
        try:
            yield from _read_file(file, pick)
        except OSError as exc:
            yield Unreadable(str(file), f"cannot read the file: {exc}")


def _read_file(file: Path, pick: Pick) -> Iterator[Record]:
    if file.suffix in _LINES:
        yield from _read_lines(file, pick)
    elif file.suffix in _DOCUMENTS:
        yield from _read_document(file, pick)
    else:
        text = file.read_text(encoding="utf-8", errors="replace")
        yield from _records(text, str(file), pick, file)


def _read_lines(file: Path, pick: Pick) -> Iterator[Record]:
    with file.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            location = f"{file}:{number}"
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                yield Unreadable(location, f"invalid JSON: {exc}")
                continue
            yield from _records(obj, location, pick, file)


def _read_document(file: Path, pick: Pick) -> Iterator[Record]:
    # Loaded whole: a document is one value (the largest real one, tau-bench's, is 4 MB).
    try:
        obj = orjson.loads(file.read_bytes())
    except orjson.JSONDecodeError as exc:
        if _first_line_is_json(file):
            yield from _read_lines(file, pick)  # JSON Lines under a .json name
        else:
            yield Unreadable(str(file), f"invalid JSON: {exc}")
        return
    adapter = pick(obj)
    if isinstance(obj, list) and (adapter is None or not adapter.looks_like(obj)):
        for index, item in enumerate(obj):
            yield from _records(item, f"{file}#{index}", pick, file)
    else:
        yield from _records(obj, str(file), pick, file)


def _first_line_is_json(file: Path) -> bool:
    with file.open("rb") as lines:
        first = next((line for line in lines if line.strip()), b"")
    try:
        orjson.loads(first)
    except orjson.JSONDecodeError:
        return False
    return True


def _records(obj: Any, location: str, pick: Pick, file: Path) -> Iterator[Record]:
    """The traces in one record. A record with several gets `#n` locations; an error
    ends the record with one Unreadable at the trajectory where it happened."""
    adapter = pick(obj)
    if adapter is None:
        yield Unreadable(location, f"no adapter recognises this record ({_shape(obj)})")
        return
    for record in _parsed(obj, location, adapter):
        if isinstance(record, Parsed):
            _fill_from_file_name(record.trace, adapter, file)
        yield record


def _parsed(obj: Any, location: str, adapter: Adapter) -> Iterator[Record]:
    count = 0
    held: Trace | None = None  # one trace of lookahead: does the record hold several?
    try:
        for trace in adapter.parse(obj):
            if held is not None:
                yield Parsed(_identified(held), f"{location}#{count - 1}")
            held, count = trace, count + 1
    except _RECORD_ERRORS as exc:
        if held is not None:
            yield Parsed(_identified(held), f"{location}#{count - 1}")
        where = f"{location}#{count}" if count else location
        yield Unreadable(where, f"{adapter.NAME}: {_describe(exc)}")
        return
    if held is None:
        yield Unreadable(location, f"{adapter.NAME}: the record holds no trajectory")
    else:
        yield Parsed(_identified(held), location if count == 1 else f"{location}#{count - 1}")


def _fill_from_file_name(trace: Trace, adapter: Adapter, file: Path) -> None:
    """env, agent and model where the record leaves them out and the file's name says
    them (tau-bench's `gpt-4o-airline.json`). After the id: an id derived from the
    content stays what earlier imports of the same file derived."""
    named = getattr(adapter, "from_file_name", None)
    if named is None:
        return
    facts: dict[str, str] = named(file.stem)
    if trace.env is None and "env" in facts:
        trace.env = facts["env"]
    if trace.agent.model is None and "model" in facts:
        trace.agent.model = facts["model"]
    if trace.agent.name is None and "agent" in facts:
        trace.agent.name = facts["agent"]


def _identified(trace: Trace) -> Trace:
    if trace.trace_id is None:
        trace.trace_id = stable_id(trace)
    return trace


def _describe(exc: Exception) -> str:
    if isinstance(exc, Unusable):
        return str(exc)
    if isinstance(exc, KeyError):
        return f"missing field {exc}"
    return f"{type(exc).__name__}: {exc}"


def _shape(obj: Any) -> str:
    if isinstance(obj, dict):
        return "keys: " + ", ".join(sorted(map(str, obj))[:12])
    if isinstance(obj, str):
        return "text"
    return type(obj).__name__
