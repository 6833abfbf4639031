"""OTLP/HTTP's answers (the specification's "OTLP/HTTP Response"), in the encoding of
the request: 200 with an ExportTraceServiceResponse (its partial_success counting the
spans left out), and every failure as a google.rpc.Status with the hub's status code
(400 a body that does not decode, 429/503 with Retry-After, on which exporters retry).
In JSON the Status also carries the hub's `{"error": ...}`, so that it is both shapes.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceResponse,
)
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from app.api.responses import JSONResponse
from app.errors import HubError
from app.formats.otlp import wire
from app.ingest.otlp.receiver import PROTOBUF_TYPES, Receipt
from app.ingest.otlp.request import Encoding

PROTOBUF = PROTOBUF_TYPES[0]
_MARK = "atropos.otlp"  # the request's scope key: its OTLP encoding, once known
# google.rpc.Code for the hub's statuses (what an OTLP client may log or map).
_GRPC_CODES = {400: 3, 401: 16, 403: 7, 404: 5, 409: 6, 413: 8, 415: 3, 422: 3, 429: 8, 503: 14}
_INTERNAL = 13


class PartialSuccess(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    rejected_spans: str = Field(
        alias="rejectedSpans", description="Spans left out (a 64-bit integer, as a string)"
    )
    error_message: str = Field(alias="errorMessage", description="Why, for the first few")


class ExportTraceResult(BaseModel):
    """OTLP/JSON's ExportTraceServiceResponse: empty when every span was stored."""

    partial_success: PartialSuccess | None = Field(None, alias="partialSuccess")


def mark(request: Request, encoding: Encoding | None) -> None:
    """The request is OTLP: its errors are answered as OTLP's (`error_response`);
    None: it is not after all. Kept in the request's own scope: `request.state` is the
    lifespan's state, which an ASGI server need not copy for each request."""
    request.scope[_MARK] = encoding


def answer(receipt: Receipt, encoding: Encoding) -> Response:
    if encoding == "protobuf":
        message = ExportTraceServiceResponse()
        if receipt.rejected:
            message.partial_success.CopyFrom(
                ExportTracePartialSuccess(
                    rejected_spans=receipt.rejected, error_message=receipt.message
                )
            )
        return Response(message.SerializeToString(), media_type=PROTOBUF)
    body: dict[str, Any] = {}
    if receipt.rejected:
        body["partialSuccess"] = {
            "rejectedSpans": str(receipt.rejected),
            "errorMessage": receipt.message,
        }
    return JSONResponse(body)


def error_response(request: Request, exc: HubError) -> Response | None:
    """The error as a google.rpc.Status when the request was OTLP (by its protobuf
    Content-Type, or marked once its JSON was read); None otherwise."""
    encoding = request.scope.get(_MARK)
    if encoding is None and _media(request) in PROTOBUF_TYPES:
        encoding = "protobuf"
    if encoding is None:
        return None
    code = _GRPC_CODES.get(exc.status, _INTERNAL)
    headers = exc.headers() or None
    if encoding == "protobuf":
        body = wire.status(code, exc.message)
        return Response(body, status_code=exc.status, headers=headers, media_type=PROTOBUF)
    # OTLP/JSON: a google.rpc.Status that is also the hub's error shape.
    status = {"code": code, "message": exc.message, **exc.to_json()}
    return JSONResponse(status, status_code=exc.status, headers=headers)


def _media(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


# --- the OpenAPI document (app/api/openapi.py adds the protobuf errors) -------------

REQUEST_CONTENT: dict[str, Any] = {
    PROTOBUF: {
        "schema": {"type": "string", "format": "binary",
                   "description": "OTLP ExportTraceServiceRequest (opentelemetry-proto)"}
    },
}
ANSWER: dict[int | str, dict[str, Any]] = {
    200: {
        "model": ExportTraceResult,
        "description": "OTLP (protobuf, or JSON with resourceSpans): the spans are stored; "
        "partialSuccess counts those left out. In the request's encoding.",
        "content": {PROTOBUF: {"schema": {"type": "string", "format": "binary"}}},
    },
}
