"""The generic formats (native, openai, sharegpt/Hermes, atif) are app.formats' job;
records in them are handed over to `app.formats.parse`.

The import is lazy so that the source adapters work, and report such records as
unreadable with a clear reason, where app.formats is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from app.domain import Trace
from app.errors import HubError
from app.import_sources._common import Unusable

FORMATS = ("native", "openai", "sharegpt", "atif")

# Keys by which a record shows it is in one of the generic formats.
_MARKERS = ("conversations", "messages", "steps", "schema_version")


class Delegate:
    """An adapter that hands records to app.formats, as `fmt` (None = let it detect)."""

    def __init__(self, fmt: str | None = None) -> None:
        self.fmt = fmt
        self.NAME = fmt or "generic"

    def looks_like(self, obj: Any) -> bool:
        return isinstance(obj, dict) and any(key in obj for key in _MARKERS)

    def parse(self, obj: Any) -> Iterator[Trace]:
        try:
            from app.formats import parse  # type: ignore[import-not-found, unused-ignore]
        except ImportError as exc:
            raise Unusable(
                f"records in the generic formats ({', '.join(FORMATS)}) are read by "
                f"app.formats, which is not available here ({exc})"
            ) from exc
        try:
            yield parse(obj, self.fmt)
        except HubError as exc:
            raise Unusable(exc.message) from exc
