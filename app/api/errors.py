"""One place that turns every failure into `{"error": {"code", "message", "field"?}}`."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from app.api import otlp
from app.api.responses import JSONResponse
from app.errors import HubError

log = logging.getLogger("atropos.api")


def error_response(exc: HubError) -> JSONResponse:
    return JSONResponse(exc.to_json(), status_code=exc.status, headers=exc.headers() or None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HubError)
    async def _hub_error(request: Request, exc: HubError) -> Response:
        return otlp.error_response(request, exc) or error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [str(part) for part in first.get("loc", ()) if part not in ("query", "body", "path")]
        field = ".".join(loc) or None
        message = f"{field}: {first['msg']}" if field else str(first["msg"])
        body = {"error": {"code": "invalid", "message": message, "field": field}}
        return JSONResponse(body, status_code=422)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        codes = {400: "malformed_json", 404: "not_found", 405: "method_not_allowed"}
        code = codes.get(exc.status_code, "http_error")
        body = {"error": {"code": code, "message": str(exc.detail)}}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        body = {"error": {"code": "internal", "message": "internal error; see the server log"}}
        return JSONResponse(body, status_code=500)
