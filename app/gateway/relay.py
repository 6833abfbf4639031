"""The gateway's streamed answers, relayed to the agent as the upstream sends them."""

from __future__ import annotations

import asyncio

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class RelayedStream(StreamingResponse):
    """A stream relayed as its source yields it. The head leaves with the first chunk
    (one write on the wire for both). When the client goes, the source is cancelled
    where it waits, as Starlette's StreamingResponse does; but by one watching task
    rather than an anyio task group per response, whose tasks cost a streamed gateway
    call more than its relaying (docs/decisions.md)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relaying = asyncio.current_task()
        assert relaying is not None
        streaming = True

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if streaming:
                relaying.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await self._relay(send)
        except asyncio.CancelledError:
            if not watcher.done() or watcher.cancelled():
                raise  # not the client's going: a cancellation of the request's own
            relaying.uncancel()
        finally:
            streaming = False
            watcher.cancel()

    async def _relay(self, send: Send) -> None:
        head = {"type": "http.response.start", "status": self.status_code,
                "headers": self.raw_headers}
        started = False
        async for chunk in self.body_iterator:
            if not started:
                await send(head)
                started = True
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if not started:
            await send(head)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
