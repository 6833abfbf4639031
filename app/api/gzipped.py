"""Gzip for the responses of one router, as Starlette's GZipMiddleware would do for
the whole app: bodies of `MINIMUM_SIZE` bytes or more, for clients that send
`Accept-Encoding: gzip`. (atroposlib gzips everything from 1000 bytes; the hub's
other routes do not need it.)"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

MINIMUM_SIZE = 1000
# Level 3 packs batch JSON within a few per cent of level 9 in half the time.
LEVEL = 3
# Compress larger bodies in a thread: zlib releases the GIL, the loop keeps serving.
_THREAD_FROM = 64 * 1024


class GzipRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def gzip_handler(request: Request) -> Response:
            response = await handler(request)
            if "content-encoding" not in response.headers and wants_gzip(
                request, len(getattr(response, "body", b""))
            ):
                await _compress(response)
            return response

        return gzip_handler


def wants_gzip(request: Request, size: int) -> bool:
    """A body of `size` bytes goes gzipped to this client."""
    return size >= MINIMUM_SIZE and "gzip" in request.headers.get("accept-encoding", "").lower()


async def _compress(response: Response) -> None:
    body = bytes(response.body)
    if len(body) >= _THREAD_FROM:
        response.body = await asyncio.to_thread(_gzip, body)
    else:
        response.body = _gzip(body)
    response.headers["content-encoding"] = "gzip"
    response.headers["content-length"] = str(len(response.body))
    response.headers.add_vary_header("Accept-Encoding")


def _gzip(body: bytes) -> bytes:
    compressor = zlib.compressobj(LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return compressor.compress(body) + compressor.flush()
