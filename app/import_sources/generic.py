"""The formats /v1/traces accepts (app.formats: native, openai, sharegpt/Hermes, atif
and whatever else is registered there) as import sources: a record in one of them is
handed to `app.formats.parse`, which also decides whether a record is one."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from app import formats
from app.domain import Trace
from app.errors import HubError
from app.import_sources._common import Unusable

# The names `atropos import --format` takes for them.
FORMATS = tuple(formats.FORMATS)


class Delegate:
    """An adapter that hands records to app.formats, as `fmt` (None = let it detect)."""

    def __init__(self, fmt: str | None = None) -> None:
        self.fmt = fmt
        self.NAME = fmt or "generic"

    def looks_like(self, obj: Any) -> bool:
        return isinstance(obj, dict) and formats.sniff(obj) is not None

    def parse(self, obj: Any) -> Iterator[Trace]:
        try:
            yield formats.parse(obj, self.fmt)
        except HubError as exc:
            raise Unusable(exc.message) from exc
