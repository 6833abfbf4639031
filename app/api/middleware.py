"""The pure ASGI middleware around the whole app, each for one concern of every request:

- `HostCheck`: the Host header must name this hub (DNS rebinding);
- `BodiesInFlight`: each request's share of the BodyBudget (app/ingest/body.py), given
  back once it is answered;
- `PageHeaders`: what browsers are told about the dashboard's and the docs' pages.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.ingest.body import HOLD_KEY, BodyBudget

_UI = "/ui"
_DOCS = ("/docs", "/redoc", "/docs-assets")


class HostCheck:
    """Answers 400 to a request whose Host header is not a name of this hub.

    A web page can point its own domain's DNS at 127.0.0.1 after it has loaded (DNS
    rebinding): its scripts then talk to a hub on the visitor's machine as their own
    origin, with the name of that domain in Host. Names the hub answers to: any IP
    address (a page cannot rebind to a literal address), `localhost` and
    `*.localhost`, the bind address, this machine's host name, and
    trace_server.allowed_hosts (`*.example.com` for its subdomains; `*` turns the check
    off). A request without a Host header (HTTP/1.0) is answered: a browser always sends
    one."""

    def __init__(self, app: ASGIApp, bind_host: str, allowed: Iterable[str]) -> None:
        self.app = app
        names = {n.lower().rstrip(".") for n in allowed}
        self._any = "*" in names
        self._suffixes = tuple(n[1:] for n in names if n.startswith("*."))
        self._names = {n for n in names if not n.startswith("*")} | {
            "localhost", bind_host.lower(), socket.gethostname().lower()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._any:
            await self.app(scope, receive, send)
            return
        host = None
        for name, value in scope["headers"]:
            if name == b"host":
                host = value.decode("latin-1")
                break
        if host is None or self._allows(_hostname(host)):
            await self.app(scope, receive, send)
            return
        shown = host if len(host) <= 100 and host.isprintable() else repr(host[:100])
        body = orjson.dumps({"error": {
            "code": "unknown_host",
            "message": f"Host {shown!r} is not a name of this hub: add it to "
                       "trace_server.allowed_hosts if it is one (the check keeps web "
                       "pages that rebind their domain to this machine out)",
            "field": "Host",
        }})
        await send({"type": "http.response.start", "status": 400, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def _allows(self, name: str) -> bool:
        if name in self._names or name.endswith(".localhost"):
            return True
        if self._suffixes and name.endswith(self._suffixes):
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


def _hostname(host: str) -> str:
    """The name of a Host header, without its port; an IPv6 address without brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0].rstrip(".") if host.count(":") == 1 else host.rstrip(".")


class BodiesInFlight:
    """Gives each request a BodyHold (read_body takes from it) and releases it when
    the request has been answered, however it ended."""

    def __init__(self, app: ASGIApp, budget: BodyBudget) -> None:
        self.app = app
        self.budget = budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hold = self.budget.hold()
        scope[HOLD_KEY] = hold
        try:
            await self.app(scope, receive, send)
        finally:
            hold.release()


# The dashboard runs no script but its own files (the review queue's), none inline,
# loads nothing from elsewhere, posts only to itself, and is never to be framed (a frame
# under another site's page is how clicks are stolen). Its bar charts set one CSS
# variable in a style attribute.
_UI_POLICY = ("default-src 'none'; script-src 'self'; connect-src 'self'; "
              "style-src 'self'; style-src-attr 'unsafe-inline'; "
              "img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; "
              "base-uri 'none'")
_FRAMING = [(b"x-frame-options", b"DENY"), (b"x-content-type-options", b"nosniff")]
_UI_HEADERS = [*_FRAMING, (b"content-security-policy", _UI_POLICY.encode()),
               (b"referrer-policy", b"same-origin")]
# Swagger UI and ReDoc run scripts of their own (served by the hub): only framing and
# sniffing are restricted there.
_DOCS_HEADERS = [*_FRAMING, (b"content-security-policy", b"frame-ancestors 'none'")]


class PageHeaders:
    """X-Frame-Options, Content-Security-Policy and X-Content-Type-Options on the
    dashboard (/ui, its downloads and static files) and the docs pages; the API's
    JSON answers are left as they are."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "") if scope["type"] == "http" else ""
        if path == _UI or path.startswith(_UI + "/"):
            extra = _UI_HEADERS
        elif path.startswith(_DOCS):
            extra = _DOCS_HEADERS
        else:
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
