"""The OpenAPI document, true to what the hub answers: every error a route can give is
declared with the one error shape, `{"error": {"code", "message", "field"?}}`.

Routes declare their errors with `responses=errors(404, 409)`. `install_openapi`
puts the `Error` schema in the components, swaps FastAPI's own 422 model (which the
hub never sends) for it, and adds 401/403/429 to the operations the auth guard
protects (those with a `security` requirement, app/api/auth.py). It also refuses a
/v1 operation without a guard.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import TypeAdapter

from app.config import AuthConfig
from app.errors import Error

ERROR_REF = "#/components/schemas/Error"
PROTOBUF = "application/x-protobuf"
BEARER_SCHEME = "bearerAuth"
_FASTAPI_422 = "#/components/schemas/HTTPValidationError"

_WHY: dict[int, str] = {
    400: "Malformed request (bad JSON, bad gzip, empty body, bad cursor)",
    401: "No API key, or not a valid one (auth.enabled)",
    403: "The API key lacks the scope this endpoint needs",
    404: "Not found",
    409: "Conflicts with what is stored",
    413: "Over a size limit; `field` names it (limits.*)",
    415: "Content-Type or Content-Encoding not accepted",
    422: "Well-formed but invalid; `field` says where",
    429: "Over auth.rate_limit_per_second; see Retry-After",
    503: "Overloaded or unavailable; see Retry-After",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route that may answer these error statuses."""
    return {status: error_response(status) for status in statuses}


def error_response(status: int) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": _WHY.get(status, HTTPStatus(status).phrase),
        "content": {"application/json": {"schema": {"$ref": ERROR_REF}}},
    }
    if status in (429, 503):
        response["headers"] = {
            "Retry-After": {
                "description": "Seconds to wait before retrying",
                "schema": {"type": "integer"},
            }
        }
    return response


def install_openapi(app: FastAPI, auth: AuthConfig) -> None:
    """Replace app.openapi, and build the document once now: a /v1 operation without
    a scope guard stops start-up here (RuntimeError)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _document(app, auth)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    openapi()


def _document(app: FastAPI, auth: AuthConfig) -> dict[str, Any]:
    schema = get_openapi(
        title=app.title,
        version=app.version,
        summary=app.summary,
        description=app.description,
        routes=app.routes,
    )
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    error = TypeAdapter(Error).json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(error.pop("$defs", {}))
    schemas["Error"] = error
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    guard_errors = errors(*([401, 403] if auth.enabled else []),
                          *([429] if auth.rate_limit_per_second else []))
    unguarded = []
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            for response in responses.values():
                for media in response.get("content", {}).values():
                    if media.get("schema", {}).get("$ref") == _FASTAPI_422:
                        media["schema"] = {"$ref": ERROR_REF}
            if "requestBody" in operation:
                # Any body can arrive as malformed JSON.
                for status, response in errors(400).items():
                    responses.setdefault(str(status), response)
            if "security" not in operation:
                if path == "/v1" or path.startswith("/v1/"):
                    unguarded.append(f"{method.upper()} {path}")
                _protobuf_errors(operation)
                continue
            for status, response in guard_errors.items():
                responses.setdefault(str(status), response)
            if not auth.enabled:
                # Not enforced, so not advertised: a client must not think it needs a key.
                del operation["security"]
            _protobuf_errors(operation)
    if unguarded:
        raise RuntimeError(
            "these /v1 operations have no scope guard; add "
            "dependencies=[requires(Scope....)] (app/api/auth.py): " + ", ".join(unguarded)
        )
    if not auth.enabled:
        components.pop("securitySchemes", None)
    return schema


def _protobuf_errors(operation: dict[str, Any]) -> None:
    """An operation that takes protobuf (OTLP) answers its errors in protobuf too, as a
    google.rpc.Status (app/api/otlp.py)."""
    if PROTOBUF not in operation.get("requestBody", {}).get("content", {}):
        return
    status = {"schema": {"type": "string", "format": "binary",
                         "description": "google.rpc.Status"}}
    for code, response in operation["responses"].items():
        if code.startswith(("4", "5")):
            # A copy: the guard's answers are shared between operations.
            operation["responses"][code] = {
                **response, "content": {**response.get("content", {}), PROTOBUF: status}
            }
