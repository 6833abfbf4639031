"""The web dashboard under /ui: server-rendered pages (Jinja2) and their stylesheet,
all shipped in this package and served by the hub. One script of its own (the review
queue's, static/queue.js, which releases a hold when its page is left); charts are SVG
drawn on the server, long outputs fold with <details>, and every action is a form
(docs/dashboard.md).

Also here: /docs and /redoc served from assets installed with the hub (the
fastapi-offline package ships Swagger UI and ReDoc), so both work without internet.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from fastapi import APIRouter, Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from app.errors import HubError

# The pages' modules (and Jinja2) are imported by `install` and `error_page` alone: a
# hub that starts imports them once it answers (app/api/app.py), and the error handler
# of every request imports this package.

PREFIX = "/ui"
DOCS_ASSETS = "/docs-assets"


def install(router: APIRouter) -> None:
    from starlette.staticfiles import StaticFiles

    from app.api.ui import pages

    router.include_router(pages.router)
    router.mount(f"{PREFIX}/static", StaticFiles(packages=[("app.api.ui", "static")]),
                 name="ui-static")


def install_docs(router: APIRouter, title: str) -> None:
    """/docs and /redoc with Swagger UI and ReDoc from the installed package, not a CDN."""
    import fastapi_offline
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
    from starlette.staticfiles import StaticFiles

    assets = Path(fastapi_offline.__file__).parent / "static"
    redoc_js = _redoc_without_remote_logo(assets / "redoc.standalone.js")

    # Before the mount, which would otherwise answer this path first.
    @router.get(f"{DOCS_ASSETS}/redoc.standalone.js", include_in_schema=False)
    async def redoc_script() -> Response:
        return Response(redoc_js, media_type="text/javascript",
                        headers={"Cache-Control": "public, max-age=86400"})

    router.mount(DOCS_ASSETS, StaticFiles(directory=assets), name="docs-assets")

    @router.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title=f"{title} - Swagger UI",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png",
        )

    @router.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url="/openapi.json",
            title=f"{title} - ReDoc",
            redoc_js_url=f"{DOCS_ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{DOCS_ASSETS}/favicon.png",
            with_google_fonts=False,
        )


def _redoc_without_remote_logo(path: Path) -> bytes:
    """ReDoc's sidebar shows Redocly's logo from their CDN (no option turns it off):
    pointed at the hub's own icon, the page asks nothing of the internet."""
    return path.read_bytes().replace(
        b"https://cdn.redoc.ly/redoc/logo-mini.svg", f"{DOCS_ASSETS}/favicon.png".encode())


def is_page(request: Request) -> bool:
    path = request.url.path
    return path == PREFIX or path.startswith(PREFIX + "/")


async def error_page(request: Request, exc: HubError) -> Response | None:
    """A refusal on a dashboard page, as a page: a login form for a missing key, else
    the message with the status. None for a request that is not for a page."""
    if not is_page(request):
        return None
    from app.api.ui.render import render
    from app.api.ui.session import LoginNeeded, get_visitor

    if isinstance(exc, LoginNeeded):
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        if request.method != "GET":
            target = request.headers.get("referer", PREFIX)
            target = target.split(request.headers.get("host", ""), 1)[-1]
        return RedirectResponse(f"{PREFIX}/login?next={quote(target, safe='/')}",
                                status_code=303)
    visitor = await get_visitor(request, request.state.hub)
    response = render(request, visitor, "error.html", {"error": exc},
                      status=exc.status, title=f"{exc.status}: {exc.code}")
    if "Retry-After" in exc.headers():
        response.headers["Retry-After"] = exc.headers()["Retry-After"]
    return response
