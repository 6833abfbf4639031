"""Every HTTP request counted and timed (atropos_http_request_duration_seconds), by
method, route template and status.

A pure ASGI middleware: a clock read at each end, the status taken from the response's
first message, one histogram observation from a child kept per label set. The route is
the template the router matched (`/v1/traces/{trace_id:path}`), never the path itself,
so that the metric has as many series as the API has routes; a path that matched none
is `unmatched`. A refused request (4xx) is also noted for the log (app/metrics.py
`refused`).
"""

from __future__ import annotations

from time import perf_counter

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.metrics import HTTP_REQUESTS, Labeled, refused

_requests = Labeled(HTTP_REQUESTS)


class RequestMetrics:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = perf_counter()
        status = 500  # the app raised before answering: the server answers 500

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            _requests(scope["method"], template, str(status)).observe(perf_counter() - started)
            if 400 <= status < 500:
                client = scope.get("client")
                refused(client[0] if client else "unknown", status)
