"""Reading a request body as the hub accepts it: bounded in size, optionally gzip,
JSON (one object, `{"traces": [...]}` or an array) or NDJSON."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request

from app.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType

NDJSON_TYPES = ("application/x-ndjson", "application/ndjson", "application/jsonl")
# curl -d sends form-urlencoded unless told otherwise; a JSON body is what it carries.
JSON_TYPES = ("application/json", "text/plain", "application/x-www-form-urlencoded", "")


@dataclass(frozen=True, slots=True)
class Items:
    items: list[Any]  # JSON values; for one trace (not a batch), its JSON text
    batch: bool  # answered per item (207) rather than as one trace (202)
    fmt: str | None = None  # a format named for the whole batch


async def read_body(request: Request, limit: int) -> bytes:
    """The decoded body, refused with 413 as soon as it passes `limit` bytes, before
    or after gunzip (a small gzip bomb is as large as what it inflates to)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("gzip", "x-gzip"):
        body = _gunzip(body, limit)
    elif encoding not in ("identity", ""):
        raise UnsupportedMediaType(
            f"Content-Encoding {encoding!r} is not supported; send gzip or identity",
            field="Content-Encoding",
        )
    if not body.strip():
        raise BadRequest("the request body is empty; send a trace as JSON", code="empty_body")
    return body


def parse_items(body: bytes, content_type: str) -> Items:
    media = content_type.split(";")[0].strip().lower()
    if media in NDJSON_TYPES:
        return Items(_ndjson(body), batch=True)
    if media not in JSON_TYPES and not media.endswith("+json"):
        raise UnsupportedMediaType(
            f"Content-Type {media!r} is not accepted; use application/json or "
            "application/x-ndjson",
            field="Content-Type",
        )
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}", code="malformed_json") from None
    if isinstance(doc, list):
        return Items(doc, batch=True)
    if isinstance(doc, dict) and "traces" in doc:
        traces = doc["traces"]
        if not isinstance(traces, list):
            raise BadRequest('"traces" must be a list of traces', field="traces")
        fmt = doc.get("format")
        return Items(traces, batch=True, fmt=fmt if isinstance(fmt, str) else None)
    # One trace travels on as its JSON text: an ingest process reads it again faster
    # than the parsed value could be sent there.
    return Items([body], batch=False)


def _ndjson(body: bytes) -> list[Any]:
    """One item per non-blank line; a line that is not JSON becomes that item's error,
    so the good lines are still stored."""
    items: list[Any] = []
    for number, line in enumerate(body.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            items.append(orjson.loads(line))
        except orjson.JSONDecodeError as exc:
            items.append(
                BadRequest(
                    f"line {number} is not valid JSON: {exc}",
                    field=f"line {number}",
                    code="malformed_json",
                )
            )
    return items


def _gunzip(body: bytes, limit: int) -> bytes:
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, limit + 1)
        if len(out) > limit or inflater.unconsumed_tail:
            raise _too_large(limit, after_gunzip=True)
        if not inflater.eof:
            raise zlib.error("truncated gzip stream")
    except zlib.error as exc:
        raise BadRequest(
            f"the body is not valid gzip: {exc}", field="Content-Encoding", code="bad_gzip"
        ) from None
    return out


def _too_large(limit: int, *, after_gunzip: bool = False) -> PayloadTooLarge:
    what = "the decompressed body" if after_gunzip else "the body"
    return PayloadTooLarge(
        f"{what} is larger than limits.max_body_bytes ({limit} bytes)",
        field="limits.max_body_bytes",
    )
