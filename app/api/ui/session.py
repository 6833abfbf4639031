"""Who is at the dashboard, and whether a form really comes from it.

The key: with auth.enabled, a person gives an API key once (/ui/login); the hub keeps
it in a cookie that scripts cannot read (HttpOnly) and that no other site's page can
make the browser send (SameSite=Strict), and checks it on every page like a bearer
key, with the same scopes: pages need `read`, reviews `review`, a batch retry or a
run stop `admin`. Logout forgets the cookie. With auth off the dashboard is open, as
the API is.

Forms: every form that changes something carries a token that must equal the one in
a second cookie (a double-submitted token); another site can neither read that cookie
nor set it, so it cannot build a form the hub accepts. The Origin header, when the
browser sends one, must also be the hub's own.
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
from app.errors import BadRequest, Forbidden, HubError, PayloadTooLarge

KEY_COOKIE = "atropos_key"
CSRF_COOKIE = "atropos_csrf"
CSRF_FIELD = "csrf_token"
PATH = "/ui"
MAX_FORM_BYTES = 64 * 1024


class LoginNeeded(HubError):
    """No key, or one that no longer opens the hub: the page sends the person to log in."""

    status = 401
    code = "unauthorized"


@dataclass(frozen=True, slots=True)
class Visitor:
    """A request to the dashboard: its form token, and whether auth is on."""

    csrf: str
    new_csrf: bool  # the token was made for this response: set its cookie
    auth: bool
    signed_in: bool

    @property
    def session(self) -> str:
        """Stands for this browser where a name is needed (a queue claim with auth
        off): a digest of its token, never the token itself."""
        return hashlib.sha256(self.csrf.encode()).hexdigest()[:16]


async def get_visitor(request: Request, hub: HubDep) -> Visitor:
    token = request.cookies.get(CSRF_COOKIE, "")
    fresh = len(token) < 32
    return Visitor(
        csrf=secrets.token_urlsafe(32) if fresh else token,
        new_csrf=fresh,
        auth=hub.config.auth.enabled,
        signed_in=bool(request.cookies.get(KEY_COOKIE)),
    )


VisitorDep = Annotated[Visitor, Depends(get_visitor)]


async def authorize(request: Request, hub: HubDep, scope: Scope) -> Principal:
    """The key in the cookie, checked for `scope` like a bearer key (401 becomes a
    login page, 403 says which scope is missing)."""
    client = request.client.host if request.client else "unknown"
    key = request.cookies.get(KEY_COOKIE) if hub.config.auth.enabled else None
    if hub.config.auth.enabled and not key:
        raise LoginNeeded("this dashboard needs an API key")
    try:
        return await hub.access.authorize(key, client, (scope,))
    except HubError as exc:
        if exc.status == 401:
            raise LoginNeeded("that API key no longer opens this hub (revoked?)") from None
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
    """The fields of a posted form (application/x-www-form-urlencoded), once its token
    and origin are checked."""
    origin = request.headers.get("origin")
    if origin and origin != "null" and urlsplit(origin).netloc != request.headers.get("host"):
        raise Forbidden("this form was sent from another site", code="csrf")
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        raise PayloadTooLarge(f"a form is at most {MAX_FORM_BYTES} bytes")
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


def sign_in(response: Response, request: Request, key: str) -> None:
    _set(response, request, KEY_COOKIE, key)


def sign_out(response: Response) -> None:
    response.delete_cookie(KEY_COOKIE, path=PATH, httponly=True, samesite="strict")


def _set(response: Response, request: Request, name: str, value: str) -> None:
    response.set_cookie(
        name, value, path=PATH, httponly=True, samesite="strict",
        secure=request.url.scheme == "https",
    )


def safe_next(target: str | None) -> str:
    """Where to go after logging in: a page of this dashboard, never another site."""
    if not target or "\\" in target:
        return PATH
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not parts.path.startswith(PATH):
        return PATH
    return target
