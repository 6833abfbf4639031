"""Who is at the dashboard, and whether a form really comes from it.

Sessions: with auth.enabled, a person gives an API key once (/ui/login); the hub checks
it and opens a session (app/access/sessions.py). The cookie holds the session's random
id, never the key: HttpOnly (no script reads it), SameSite=Strict, and, when the hub is
reached over TLS, `Secure` with the `__Host-` prefix (no other host, port or plain-HTTP
page can set or overwrite it). Whether a request came over TLS is its scheme: https when
uvicorn serves TLS itself, or when a proxy listed in trace_server.forwarded_allow_ips
says so (X-Forwarded-Proto); no other client's header is believed. Each page checks the
session's key like a bearer key, with the same scopes: pages need `read`, reviews
`review`, a batch retry or a run stop `admin`. Logout ends the session on the server.
With auth off the dashboard is open, as the API is.

Forms: every form that changes something carries a token. With a session, it is an HMAC
of the session id: only a page the hub rendered for this session knows it, and a token
another page plants in a cookie (any server on the same host can set cookies for it)
proves nothing. Without one (the login form; auth off) it must equal the one in a second
cookie. Besides, a form is refused when the browser says it came from elsewhere: an
Origin that is not the hub's own, `Origin: null` (what a browser sends after a
cross-origin redirect, or from a sandboxed frame) or a Sec-Fetch-Site other than
same-origin.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Annotated
from urllib.parse import parse_qsl, urlsplit

from fastapi import Depends, Request
from starlette.responses import Response

from app.access.guard import Principal
from app.access.keys import Scope
from app.api.deps import HubDep
from app.errors import BadRequest, Forbidden, HubError
from app.ingest.body import read_body

SESSION_COOKIE = "atropos_session"
CSRF_COOKIE = "atropos_csrf"
CSRF_FIELD = "csrf_token"
PATH = "/ui"
MAX_FORM_BYTES = 64 * 1024
# What a form's token is derived from the session id with: the token is not the id.
_TOKEN_PURPOSE = b"atropos-hub dashboard form"
_FROM_ELSEWHERE = ("this form was sent from another site (or through a redirect from "
                   "one); send it from the dashboard's own page")


class LoginNeeded(HubError):
    """No session, or one that no longer opens the hub: the page sends the person to
    log in."""

    status = 401
    code = "unauthorized"


@dataclass(frozen=True, slots=True)
class Visitor:
    """A request to the dashboard: its form token, and whether auth is on."""

    csrf: str
    new_csrf: bool  # a double-submitted token made for this response: set its cookie
    auth: bool
    session_id: str | None  # the session cookie's value, if the browser sent one

    @property
    def signed_in(self) -> bool:
        return self.session_id is not None

    @property
    def session(self) -> str:
        """Stands for this browser where a name is needed (a queue claim with auth
        off): a digest of its token, never the token itself."""
        return hashlib.sha256(self.csrf.encode()).hexdigest()[:16]


def _tls(request: Request) -> bool:
    return request.url.scheme == "https"


def _name(request: Request, name: str) -> str:
    # A __Host- cookie must be Secure, for path /, without Domain: the browser then
    # takes it only from this very origin over TLS.
    return f"__Host-{name}" if _tls(request) else name


async def get_visitor(request: Request, hub: HubDep) -> Visitor:
    auth = hub.config.auth.enabled
    session_id = request.cookies.get(_name(request, SESSION_COOKIE)) if auth else None
    if session_id:
        return Visitor(csrf=_token(session_id), new_csrf=False, auth=auth,
                       session_id=session_id)
    token = request.cookies.get(_name(request, CSRF_COOKIE), "")
    fresh = len(token) < 32
    return Visitor(csrf=secrets.token_urlsafe(32) if fresh else token, new_csrf=fresh,
                   auth=auth, session_id=None)


def _token(session_id: str) -> str:
    return hmac.new(session_id.encode(), _TOKEN_PURPOSE, hashlib.sha256).hexdigest()


VisitorDep = Annotated[Visitor, Depends(get_visitor)]


async def authorize(request: Request, hub: HubDep, scope: Scope) -> Principal:
    """The session's key, checked for `scope` like a bearer key (401 becomes a login
    page, 403 says which scope is missing)."""
    client = request.client.host if request.client else "unknown"
    session_id = request.cookies.get(_name(request, SESSION_COOKIE))
    try:
        return await hub.access.authorize_session(session_id, client, (scope,))
    except HubError as exc:
        if exc.status == 401:
            raise LoginNeeded("this dashboard needs you to sign in") from None
        raise


def _scoped(scope: Scope) -> object:
    async def guard(request: Request, hub: HubDep) -> Principal:
        return await authorize(request, hub, scope)

    guard.__name__ = f"ui_requires_{scope}"
    return Depends(guard)


Reader = Annotated[Principal, _scoped(Scope.READ)]
Reviewer = Annotated[Principal, _scoped(Scope.REVIEW)]
Admin = Annotated[Principal, _scoped(Scope.ADMIN)]


async def read_form(request: Request, visitor: Visitor) -> dict[str, str]:
    """The fields of a posted form (application/x-www-form-urlencoded), once its
    origin and token are checked."""
    origin = request.headers.get("origin")
    if origin is not None and (origin == "null"
                               or urlsplit(origin).netloc != request.headers.get("host")):
        raise Forbidden(_FROM_ELSEWHERE, code="csrf")
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        raise Forbidden(_FROM_ELSEWHERE, code="csrf")
    try:
        body = await read_body(request, MAX_FORM_BYTES)
    except BadRequest as exc:
        if exc.code != "empty_body":
            raise
        body = b""
    try:
        fields = dict(parse_qsl(body.decode(), keep_blank_values=True, strict_parsing=False))
    except UnicodeDecodeError:
        raise BadRequest("the form is not UTF-8") from None
    sent = fields.pop(CSRF_FIELD, "")
    if visitor.new_csrf or not hmac.compare_digest(sent, visitor.csrf):
        raise Forbidden(
            "this form has expired or did not come from this dashboard: reload the page "
            "and send it again", code="csrf")
    return fields


def remember(response: Response, request: Request, visitor: Visitor) -> Response:
    """Set the form-token cookie on a page that made one."""
    if visitor.new_csrf:
        _set(response, request, CSRF_COOKIE, visitor.csrf)
    return response


def sign_in(response: Response, request: Request, session_id: str, max_age: int) -> None:
    _set(response, request, SESSION_COOKIE, session_id, max_age=max_age)


def sign_out(response: Response, request: Request) -> None:
    tls = _tls(request)
    response.delete_cookie(_name(request, SESSION_COOKIE), path="/" if tls else PATH,
                           secure=tls, httponly=True, samesite="strict")


def _set(response: Response, request: Request, name: str, value: str,
         max_age: int | None = None) -> None:
    tls = _tls(request)
    response.set_cookie(
        _name(request, name), value, max_age=max_age, path="/" if tls else PATH,
        httponly=True, samesite="strict", secure=tls,
    )


def safe_next(target: str | None) -> str:
    """Where to go after logging in: a page of this dashboard, never another site."""
    if not target or "\\" in target:
        return PATH
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not parts.path.startswith(PATH):
        return PATH
    return target
