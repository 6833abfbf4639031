"""What a format module declares about itself: one `Format` record, registered in
`app.formats.REGISTERED`. Detection, its error message, the names `parse` and
`export` accept, `distributor.format`, the step limits and `atropos import` are all
derived from these records."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.domain import Trace


@dataclass(frozen=True)
class Export:
    """One trace written as one JSON record (`atropos export`, the batch targets)."""

    name: str
    write: Callable[[Trace], dict[str, Any]]
    # A record trainers take: offered as distributor.format.
    training: bool = True


@dataclass(frozen=True)
class Format:
    """A format /v1/traces accepts (items of it, parsed into the canonical trace)."""

    name: str
    parse: Callable[[dict[str, Any]], Trace]
    # Whether an item without a "format" key is in this format, judged only by which
    # keys it has; None: the format is used only when named.
    looks_like: Callable[[dict[str, Any]], bool] | None = None
    # What `looks_like` looks for, as the detection error lists it: "'messages'".
    detected_by: str = ""
    # Other names "format" may give it ("hermes" for sharegpt).
    aliases: tuple[str, ...] = ()
    # Top-level keys holding the item's steps, counted against
    # limits.max_steps_per_trace before the item is parsed.
    step_lists: tuple[str, ...] = ()
    exports: tuple[Export, ...] = ()
    # How an item handed over as bytes is read, when not as JSON text (app.formats.load).
    load: Callable[[bytes], dict[str, Any]] | None = None
