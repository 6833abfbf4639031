"""One place that turns every failure into `{"error": {"code", "message", "field"?}}`."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from app.api import otlp
from app.api.responses import JSONResponse
from app.db.errors import database_error, database_refusal
from app.errors import BadRequest, Error, HubError, Invalid, NotFound, Unavailable

# Renders an error as a web page for the requests that asked for a page (the
# dashboard's), None for the others, which get the JSON body.
PageRenderer = Callable[[Request, HubError], Awaitable[Response | None]]

log = logging.getLogger("atropos.api")


def error_response(exc: HubError) -> JSONResponse:
    return JSONResponse(exc.to_json(), status_code=exc.status, headers=exc.headers() or None)


def install_error_handlers(app: FastAPI, page: PageRenderer | None = None) -> None:
    async def as_page(request: Request, exc: HubError) -> Response | None:
        return await page(request, exc) if page is not None else None

    @app.exception_handler(HubError)
    async def _hub_error(request: Request, exc: HubError) -> Response:
        # An OTLP request's errors in OTLP's shape; a dashboard page's as a page.
        return (
            otlp.error_response(request, exc)
            or await as_page(request, exc)
            or error_response(exc)
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        invalid = Invalid.from_pydantic(exc.errors())
        return await as_page(request, invalid) or error_response(invalid)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        codes = {400: "malformed_json", 404: "not_found", 405: "method_not_allowed"}
        code = codes.get(exc.status_code, "http_error")
        if exc.status_code in (400, 404):
            kind = NotFound if exc.status_code == 404 else BadRequest
            shown = await as_page(request, kind(str(exc.detail), code=code))
            if shown is not None:
                return shown
        body: Error = {"error": {"code": code, "message": str(exc.detail)}}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(SQLAlchemyError)
    async def _database(request: Request, exc: SQLAlchemyError) -> Response:
        # A lock, a full disk, a lost connection: 503, never a 500 (app/db/errors.py),
        # said once per kind of failure, not per request.
        error = database_error(exc)
        if isinstance(error, Unavailable):
            request.state.hub.outages.database.failed(
                exc, f"answering {request.method} {request.url.path}")
        else:
            # Not str(exc): it carries the statement and its parameters (trace contents).
            said = database_refusal(exc) or type(exc).__name__
            log.warning("%s %s: %s (%s)", request.method, request.url.path, error.message, said)
        return otlp.error_response(request, error) or error_response(error)

    @app.exception_handler(OSError)
    async def _os_error(request: Request, exc: OSError) -> Response:
        # asyncpg's lost or refused connections are OSErrors that SQLAlchemy does not
        # wrap when they happen outside a statement: the database failing, so 503 with
        # Retry-After (OTLP exporters retry only 429, 502, 503, 504), never a 500.
        request.state.hub.outages.database.failed(
            exc, f"answering {request.method} {request.url.path}")
        error = Unavailable(
            f"the database is not available for this now ({type(exc).__name__}); retry",
            retry_after=request.state.hub.config.limits.retry_after_seconds,
        )
        return otlp.error_response(request, error) or error_response(error)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> JSONResponse:
        # The client left mid-body, or was timed out (app/api/server.py): its own
        # business, one INFO line; nobody is there to read the answer.
        peer = request.client.host if request.client else "unknown"
        log.info("%s %s from %s: the body stopped before its end (the client disconnected, "
                 "or stalled past trace_server.body_timeout_seconds); nothing of it was "
                 "stored", request.method, request.url.path, peer)
        body: Error = {"error": {"code": "client_disconnected",
                                 "message": "the client went away"}}
        return JSONResponse(body, status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        body: Error = {"error": {"code": "internal",
                                 "message": "internal error; see the server log"}}
        return JSONResponse(body, status_code=500)
