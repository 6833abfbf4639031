"""Reading a request body as the hub accepts it: bounded in size, optionally gzip,
JSON (one object, `{"traces": [...]}` or an array) or NDJSON.

The items of a batch are counted before any of them is built, and a request with more
than its limit is refused (413) with nothing else done: a few kilobytes of gzip can
hold millions of `{}`, each a Python object of ~100 bytes once parsed. Array items
travel on as their JSON text, which the ingest processes parse.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request

from app.errors import (
    BadRequest,
    HubError,
    Invalid,
    PayloadTooLarge,
    Unavailable,
    UnsupportedMediaType,
)

NDJSON_TYPES = ("application/x-ndjson", "application/ndjson", "application/jsonl")
# curl -d sends form-urlencoded unless told otherwise; a JSON body is what it carries.
JSON_TYPES = ("application/json", "text/plain", "application/x-www-form-urlencoded", "")


# Where a request's BodyHold travels: in its ASGI scope (app/api/middleware.py).
HOLD_KEY = "atropos.body_hold"
# Gzip is inflated this much at a time, each step counted before the next.
_INFLATE_STEP = 1024 * 1024


class BodyBudget:
    """The request body bytes (as received, and once gunzipped) that all the requests
    of one hub process hold at once, bounded by limits.max_body_bytes_in_flight. Past
    it a request gets 503 with Retry-After while it is still being read: a few
    kilobytes of gzip each inflate to max_body_bytes, and a few dozen of them at once
    would otherwise take the process's memory. A request alone in flight is always
    let through, so that every body max_body_bytes allows can be sent."""

    def __init__(self, max_bytes: int, retry_after: int) -> None:
        self.max_bytes = max_bytes
        self.retry_after = retry_after
        self.held = 0

    def hold(self) -> BodyHold:
        return BodyHold(self)


class BodyHold:
    """What one request holds of the budget; given back when it has been answered."""

    __slots__ = ("_budget", "size")

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self.size = 0

    def take(self, n: int) -> None:
        budget = self._budget
        if budget.held + n > budget.max_bytes and budget.held > self.size:
            raise Unavailable(
                f"the hub is reading more request bodies than "
                f"limits.max_body_bytes_in_flight ({budget.max_bytes} bytes) allows at "
                f"once; retry after {budget.retry_after} s",
                retry_after=budget.retry_after,
                field="limits.max_body_bytes_in_flight",
                code="overloaded",
            )
        budget.held += n
        self.size += n

    def release(self) -> None:
        self._budget.held -= self.size
        self.size = 0


def _taker(request: Request) -> Callable[[int], None]:
    hold: BodyHold | None = request.scope.get(HOLD_KEY)
    return hold.take if hold is not None else _no_budget


def _no_budget(n: int) -> None:
    """A request served without the middleware (an app built without it)."""


@dataclass(frozen=True, slots=True)
class Items:
    items: list[Any]  # JSON values, or their JSON text (bytes)
    batch: bool  # answered per item (207) rather than as one trace (202)
    fmt: str | None = None  # a format named for the whole batch


async def read_body(request: Request, limit: int,
                    limit_name: str = "limits.max_body_bytes") -> bytes:
    """The decoded body, refused with 413 as soon as it passes `limit` bytes, before
    or after gunzip (a small gzip bomb is as large as what it inflates to), and with
    503 when the hub's BodyBudget is spent."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, limit_name)
    take = _taker(request)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, limit_name)
        take(len(chunk))
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("gzip", "x-gzip"):
        body = _gunzip(body, limit, limit_name, take)
    elif encoding not in ("identity", ""):
        raise UnsupportedMediaType(
            f"Content-Encoding {encoding!r} is not supported; send gzip or identity",
            field="Content-Encoding",
        )
    if not body.strip():
        raise BadRequest("the request body is empty; send a trace as JSON", code="empty_body")
    return body


def parse_items(body: bytes, content_type: str, max_items: int) -> Items:
    """The items of a body; PayloadTooLarge past `max_items` (limits.max_traces_per_request)
    before any item is parsed."""
    media = content_type.split(";")[0].strip().lower()
    if media in NDJSON_TYPES:
        return Items(_ndjson(body, max_items), batch=True)
    if media not in JSON_TYPES and not media.endswith("+json"):
        raise UnsupportedMediaType(
            f"Content-Type {media!r} is not accepted; use application/json or "
            "application/x-ndjson",
            field="Content-Type",
        )
    blanks = _BLANKS.match(body)
    assert blanks is not None  # the pattern matches the empty string
    start = blanks.end()
    if body.startswith(b"[", start):
        doc = _text(body)
        return Items(_array(doc, start, max_items, _too_many_traces(max_items)), batch=True)
    # The envelope is looked for only where it can be: one trace travels on as its
    # JSON text, unparsed here (an ingest process reads it faster than a parsed value
    # could be sent there).
    if body.startswith(b"{", start) and b'"traces"' in body:
        found = _envelope(_text(body), start, max_items)
        if found is not None:
            return found
    return Items([body], batch=False)


def json_array(body: bytes, max_items: int, too_many: HubError) -> list[bytes]:
    """The JSON text of each item of a body that is one JSON array; `too_many` is
    raised at item `max_items + 1`, before it is parsed."""
    doc = _text(body)
    start = _skip_space(doc, 0)
    if not doc.startswith("[", start):
        _end_of_body(doc, _value_end(doc, start))  # 400 if it is not JSON at all
        raise Invalid("the body must be a JSON array")
    return _array(doc, start, max_items, too_many)


# Parses one JSON value, starting at an index; the C scanner of the standard library,
# which, unlike orjson, can say where a value ends, so that an array is taken apart an
# item at a time. (It builds each item; the item is dropped once measured.)
_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")
_BLANKS = re.compile(rb"[ \t\n\r]*")
# A line holding more than blanks, from its first character. Blank lines are skipped
# in C, so that millions of them cost no Python loop. (Linear: no backtracking.)
_LINE = re.compile(rb"[^ \t\r\n\f\v][^\r\n]*")


def _text(body: bytes) -> str:
    try:
        return body.decode()
    except UnicodeDecodeError as exc:
        raise BadRequest(
            f"the body is not valid JSON: it is not UTF-8 ({exc.reason} at byte {exc.start})",
            code="malformed_json",
        ) from None


def _skip_space(doc: str, index: int) -> int:
    match = _SPACE.match(doc, index)
    assert match is not None  # the pattern matches the empty string
    return match.end()


def _array(doc: str, start: int, max_items: int, too_many: HubError) -> list[bytes]:
    """The JSON text of each item of the array opening at doc[start]; nothing may
    follow it but blanks."""
    items, end = _array_items(doc, start, max_items, too_many)
    _end_of_body(doc, end)
    return items


def _array_items(
    doc: str, start: int, max_items: int, too_many: HubError
) -> tuple[list[bytes], int]:
    items: list[bytes] = []
    index = _skip_space(doc, start + 1)
    if doc.startswith("]", index):
        return items, index + 1
    while True:
        if len(items) == max_items:
            raise too_many
        end = _value_end(doc, index)
        items.append(doc[index:end].encode())
        index = _skip_space(doc, end)
        if doc.startswith(",", index):
            index = _skip_space(doc, index + 1)
        elif doc.startswith("]", index):
            return items, index + 1
        else:
            raise _malformed("expected ',' or ']' after an array item", doc, index)


def _envelope(doc: str, start: int, max_items: int) -> Items | None:
    """`{"traces": [...], "format"?: ...}` as Items; None for an object without
    "traces" (one trace). Other keys' values are parsed, and dropped."""
    traces: list[bytes] | None = None
    fmt: Any = None
    index = _skip_space(doc, start + 1)
    while not doc.startswith("}", index):
        if not doc.startswith('"', index):
            raise _malformed("expected a key in double quotes", doc, index)
        key, index = _value(doc, index)
        index = _skip_space(doc, index)
        if not doc.startswith(":", index):
            raise _malformed("expected ':' after a key", doc, index)
        index = _skip_space(doc, index + 1)
        if key == "traces":
            if not doc.startswith("[", index):
                raise BadRequest('"traces" must be a list of traces', field="traces")
            traces, index = _array_items(doc, index, max_items, _too_many_traces(max_items))
        else:
            value, index = _value(doc, index)
            if key == "format":
                fmt = value
        index = _skip_space(doc, index)
        if doc.startswith(",", index):
            index = _skip_space(doc, index + 1)
        elif not doc.startswith("}", index):
            raise _malformed("expected ',' or '}' after a value", doc, index)
    _end_of_body(doc, index + 1)
    if traces is None:
        return None
    return Items(traces, batch=True, fmt=fmt if isinstance(fmt, str) else None)


def _value(doc: str, index: int) -> tuple[Any, int]:
    try:
        return _DECODER.raw_decode(doc, index)
    except json.JSONDecodeError as exc:
        raise _malformed(exc.msg, doc, exc.pos) from None
    except RecursionError:
        raise _malformed("nested too deeply", doc, index) from None


def _value_end(doc: str, index: int) -> int:
    return _value(doc, index)[1]


def _end_of_body(doc: str, index: int) -> None:
    index = _skip_space(doc, index)
    if index != len(doc):
        raise _malformed("unexpected content after the JSON value", doc, index)


def _malformed(what: str, doc: str, index: int) -> BadRequest:
    line = doc.count("\n", 0, index) + 1
    column = index - doc.rfind("\n", 0, index)
    return BadRequest(
        f"the body is not valid JSON: {what}: line {line} column {column} (char {index})",
        code="malformed_json",
    )


def _ndjson(body: bytes, max_items: int) -> list[Any]:
    """One item per non-blank line; a line that is not JSON becomes that item's error,
    so the good lines are still stored. The lines are counted before any is parsed."""
    lines: list[re.Match[bytes]] = []
    for match in _LINE.finditer(body):
        if len(lines) == max_items:
            raise _too_many_traces(max_items)
        lines.append(match)
    items: list[Any] = []
    number, counted = 1, 0
    for match in lines:
        number += body.count(b"\n", counted, match.start())
        counted = match.start()
        try:
            items.append(orjson.loads(match[0]))
        except orjson.JSONDecodeError as exc:
            items.append(
                BadRequest(
                    f"line {number} is not valid JSON: {exc}",
                    field=f"line {number}",
                    code="malformed_json",
                )
            )
    return items


def _too_many_traces(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"more than {limit} traces in one request; limits.max_traces_per_request is "
        f"{limit}: send them in several requests",
        field="limits.max_traces_per_request",
    )


def _gunzip(body: bytes, limit: int, limit_name: str = "limits.max_body_bytes",
            take: Callable[[int], None] = _no_budget) -> bytes:
    """Every member (`gzip -c a b` writes two, RFC 1952 allows it), to at most `limit`
    bytes in all; zero bytes after the last member are padding. Inflated a step at a
    time, each step taken from the budget (`take`) before the next is made."""
    out: list[bytes] = []
    size = 0
    rest = body
    try:
        while True:
            inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            data = rest
            while not inflater.eof:
                chunk = inflater.decompress(data, min(_INFLATE_STEP, limit + 1 - size))
                data = inflater.unconsumed_tail
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit, limit_name, after_gunzip=True)
                take(len(chunk))
                out.append(chunk)
                if not chunk and not data:
                    break
            if not inflater.eof:
                raise zlib.error("truncated gzip stream")
            rest = inflater.unused_data
            if not rest.strip(b"\x00"):
                break
    except zlib.error as exc:
        raise BadRequest(
            f"the body is not valid gzip: {exc}", field="Content-Encoding", code="bad_gzip"
        ) from None
    return b"".join(out)


def _too_large(limit: int, limit_name: str = "limits.max_body_bytes", *,
               after_gunzip: bool = False) -> PayloadTooLarge:
    what = "the decompressed body" if after_gunzip else "the body"
    return PayloadTooLarge(
        f"{what} is larger than {limit_name} ({limit} bytes)",
        field=limit_name,
    )
