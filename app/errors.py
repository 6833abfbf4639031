"""The hub's errors: each carries a stable `code`, an HTTP status and, where one
applies, the `field` at fault. One handler in `api/app.py` renders them as
`{"error": {"code", "message", "field"?}}`.

HubError
 ├── BadRequest (400)             malformed JSON, bad gzip, empty body
 │    └── UnknownFormat (400)
 ├── UnsupportedMediaType (415)
 ├── Invalid (422)                well-formed, but wrong types or values
 │    └── Unexportable (422)      a trace the export format cannot hold (no assistant turn)
 ├── NotFound (404)
 ├── Conflict (409)               a trace_id resent with other content
 ├── PayloadTooLarge (413)        a size limit; `field` names it (limits.max_...)
 ├── Unauthorized (401)           no key, or not a valid one; WWW-Authenticate: Bearer
 ├── Forbidden (403)              a valid key without the scope the route needs
 ├── RateLimited (429)            over auth.rate_limit_per_second; carries Retry-After
 ├── Unavailable (503)            overload; carries Retry-After
 ├── BadGateway (502)             the gateway's upstream is unreachable or failed mid-answer
 └── GatewayTimeout (504)         the gateway's upstream did not answer in time
StartupError                      stops start-up with one line (no tokenizer, ...)
 └── ConfigError                  a bad config file
ServiceError                      a service the hub calls failed or refused (one line, the fix)
 ├── LLMError                     the model endpoint (app/llm.py holds its own subtree)
 ├── DeliveryError                a delivery target: the http target's URL, the jsonl directory
 └── TrainingFailed               a training job ended other than succeeded
      └── TrainingTimeout         still running after tinker.job_timeout_seconds

Foreign errors (httpx's, OSError, an SDK's) are translated into a ServiceError where the
hub calls the service (app/llm.py, app/targets, app/training), so nothing above those
clients catches them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NotRequired

from typing_extensions import TypedDict  # pydantic needs this one on 3.11


class ErrorDetail(TypedDict):
    code: str
    message: str
    field: NotRequired[str]


class Error(TypedDict):
    """Every 4xx/5xx the hub answers: a HubError's body (`to_json`), and the schema the
    OpenAPI document declares for it (app/api/openapi.py)."""

    error: ErrorDetail


class HubError(Exception):
    status = 500
    code = "internal"

    def __init__(self, message: str, *, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        if code is not None:
            self.code = code

    def headers(self) -> dict[str, str]:
        """Response headers that belong to this error (Retry-After, WWW-Authenticate)."""
        return {}

    def to_json(self) -> Error:
        body: ErrorDetail = {"code": self.code, "message": self.message}
        if self.field is not None:
            body["field"] = self.field
        return {"error": body}


class BadRequest(HubError):
    status = 400
    code = "bad_request"


class UnknownFormat(HubError):
    """Well-formed JSON in no format the hub knows: the body parsed, its content is
    what is wrong (422, as for any other invalid trace)."""

    status = 422
    code = "unknown_format"


class UnsupportedMediaType(HubError):
    status = 415
    code = "unsupported_media_type"


class Invalid(HubError):
    status = 422
    code = "invalid"

    @classmethod
    def from_pydantic(cls, errors: Sequence[Mapping[str, Any]]) -> Invalid:
        """The first of pydantic's (or FastAPI's) errors, `field` its location; the
        message counts the others."""
        first = errors[0]
        loc = [str(part) for part in first.get("loc", ()) if part not in ("query", "body", "path")]
        field = ".".join(loc) or None
        message = f"{field}: {first['msg']}" if field else str(first["msg"])
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more)"
        return cls(message, field=field)


class Unexportable(Invalid):
    code = "unexportable"


class NotFound(HubError):
    status = 404
    code = "not_found"


class Conflict(HubError):
    status = 409
    code = "conflict"


class PayloadTooLarge(HubError):
    status = 413
    code = "payload_too_large"


class Unauthorized(HubError):
    status = 401
    code = "unauthorized"

    def headers(self) -> dict[str, str]:
        # RFC 6750: a 401 names the scheme the client should use.
        return {"WWW-Authenticate": 'Bearer realm="atropos-hub"'}


class Forbidden(HubError):
    status = 403
    code = "forbidden"


class _RetryLater(HubError):
    """A refusal that is not the client's fault: it may retry after `retry_after` s."""

    def __init__(self, message: str, *, retry_after: int = 1, **kwargs: Any):
        super().__init__(message, **kwargs)
        self.retry_after = max(1, retry_after)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class RateLimited(_RetryLater):
    status = 429
    code = "rate_limited"


class Unavailable(_RetryLater):
    status = 503
    code = "unavailable"


class BadGateway(HubError):
    status = 502
    code = "upstream_unreachable"


class GatewayTimeout(HubError):
    status = 504
    code = "upstream_timeout"


class StartupError(Exception):
    """What stops a command before it starts: the message is one line, with the fix."""


class ConfigError(StartupError):
    """A config file that cannot be used; the message is one line naming the file,
    the key and the fix."""


class ServiceError(Exception):
    """A service the hub calls failed or refused: the message says which, and what to do.
    A stage records it (a batch's last_error) in one line, without a traceback."""


class DeliveryError(ServiceError):
    """A delivery that failed in a way the target could describe (the message becomes
    the batch's last_error)."""


class TrainingFailed(ServiceError):
    """The training job ended in a state other than success; the message says why."""


class TrainingTimeout(TrainingFailed):
    """The job was still running after tinker.job_timeout_seconds; a later attempt
    resumes polling it."""
