"""Gateway errors and the one function that renders them as OpenAI error bodies.

Every error a client can see is an :class:`APIError` with an HTTP status, an OpenAI
``type``, a ``code`` and (when one field is at fault) a ``param``. Handlers never build
error JSON by hand.

The OpenAPI document says the same: :func:`error_responses` documents error statuses with
the :class:`ErrorBody` model for a route's ``responses=``, and :func:`document_errors`
adds the errors every route can meet at the edge and drops FastAPI's 422, which this
gateway never answers (validation errors are 400).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from cluster.runtime.prometheus import DROP_REASONS


class APIError(Exception):
    """An error answered to the client."""

    status = 500
    type = "server_error"
    code: str | None = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The OpenAI error body ``{"error": {message, type, param, code}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class BadRequest(APIError):
    """The request is malformed or asks for something impossible (400)."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class NotFound(APIError):
    """Unknown model or resource (404)."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class Unauthorized(APIError):
    """No API key, or one that does not exist (401)."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PayloadTooLarge(APIError):
    """The body is over the configured bound (413)."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class TooManyRequests(APIError):
    """Refused for capacity or budget (429); always carries ``Retry-After``."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limited"


class ServiceUnavailable(APIError):
    """No capacity or a dependency is down (503); carries ``Retry-After``."""

    status = 503
    type = "server_error"
    code = "unavailable"


class SlowClient(APIError):
    """The client read its stream too slowly and was cut off (sent inside the stream)."""

    status = 429
    type = "rate_limit_error"
    code = "slow_consumer"


class GatewayTimeout(APIError):
    """The reply did not arrive in time (504)."""

    status = 504
    type = "server_error"
    code = "timeout"


class _ErrorJSON(JSONResponse):
    """JSON that renders even when a message echoes text with a lone surrogate (which
    UTF-8 cannot encode): then every non-ASCII character is escaped instead."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, separators=(",", ":")).encode()


def error_response(exc: APIError, request_id: str | None = None) -> JSONResponse:
    """Render ``exc`` as a JSON response with its status and headers."""
    headers = dict(exc.headers)
    if request_id:
        headers["x-request-id"] = request_id
    return _ErrorJSON(exc.body(), status_code=exc.status, headers=headers)


def from_worker(code: str | None, message: str | None) -> APIError:
    """Map an error chunk from a worker to the error the client sees."""
    text = message or "generation failed"
    if code == "invalid_request_error":
        return BadRequest(text)
    if code == "expired":
        return TooManyRequests(
            text,
            code="expired",
            headers={"Retry-After": "1", "X-Charserve-Drop-Reason": "expired"},
        )
    if code == "lost":
        return ServiceUnavailable(text, code="lost", headers={"Retry-After": "1"})
    if code == "cancelled":
        return ServiceUnavailable(text, code="cancelled", headers={"Retry-After": "1"})
    return APIError(text, code=code or "internal_error")


ErrorType = Literal["invalid_request_error", "rate_limit_error", "server_error"]


class ErrorDetail(BaseModel):
    """``error`` of an OpenAI error body."""

    message: str
    type: ErrorType
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """The OpenAI error body ``{"error": {message, type, param, code}}`` of every error."""

    error: ErrorDetail


_REF = "#/components/schemas/"
_INT = {"type": "string", "pattern": "^[0-9]+$"}
_RETRY_AFTER = {
    "description": "Seconds to wait before retrying.",
    "schema": _INT,
}
_DROP_REASON = {
    "description": "Why the request was refused at the door.",
    "schema": {
        "type": "string",
        "enum": list(DROP_REASONS),
    },
}
_RATE_LIMIT_HEADERS = {
    "x-ratelimit-limit-requests": {"schema": _INT},
    "x-ratelimit-remaining-requests": {"schema": _INT},
    "x-ratelimit-reset-requests": {"schema": {"type": "string"}},
    "x-ratelimit-limit-tokens": {"schema": _INT},
    "x-ratelimit-remaining-tokens": {"schema": _INT},
    "x-ratelimit-reset-tokens": {"schema": {"type": "string"}},
}
_ERRORS: dict[int, tuple[str, dict[str, Any]]] = {
    400: ("Invalid request: malformed JSON, a wrong type or value, or a bad header.", {}),
    401: ("Missing or unknown API key (once the gateway has keys).", {}),
    404: ("Unknown model, or no such resource for this tenant.", {}),
    409: ("The resource is in a state that does not allow this.", {}),
    413: ("The request body is over the configured bound.", {}),
    429: (
        "Refused: over the latency budget, queue full, rate limited, or expired.",
        {"Retry-After": _RETRY_AFTER, "X-Charserve-Drop-Reason": _DROP_REASON}
        | _RATE_LIMIT_HEADERS,
    ),
    500: ("Internal error.", {}),
    503: (
        "No worker, or a dependency (Redis) is unavailable.",
        {"Retry-After": _RETRY_AFTER, "X-Charserve-Drop-Reason": _DROP_REASON},
    ),
    504: ("No reply from any worker in time.", {}),
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` documentation of these error statuses, each an OpenAI error body."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        description, headers = _ERRORS[status]
        out[status] = {"model": ErrorBody, "description": description}
        if headers:
            out[status]["headers"] = headers
    return out


ERROR_RESPONSES = error_responses(400, 404, 429, 503, 504)
"""What ``POST /v1/chat/completions`` can answer besides the edge's errors (see
:func:`document_errors`)."""

_REQUEST_ID = {
    "description": "The request id (the client's own X-Request-Id when it is sane).",
    "required": True,
    "schema": {"type": "string", "minLength": 1, "maxLength": 128},
}


def document_errors(app: FastAPI) -> None:
    """Make ``app``'s OpenAPI document honest about errors (call after adding routes).

    Every operation gets ``x-request-id`` on every response, 413 (the body bound) and 500
    (an unexpected error) from the edge; every ``/v1`` operation also 401 and 503 (the API
    key check, see :mod:`gateway.http.middleware`) and the optional bearer key. FastAPI's 422 is
    dropped: a request that fails validation is answered 400.
    """
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _honest(build())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _honest(schema: dict[str, Any]) -> dict[str, Any]:
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    body = ErrorBody.model_json_schema(ref_template=_REF + "{model}")
    for name, definition in body.pop("$defs", {}).items():
        schemas.setdefault(name, definition)
    schemas.setdefault("ErrorBody", body)
    error_ref = {"$ref": _REF + "ErrorBody"}
    if any(path.startswith("/v1/") for path in schema.get("paths", {})):
        components.setdefault("securitySchemes", {})["bearer"] = {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key; needed once the gateway has any (open otherwise).",
        }
    for path, item in schema.get("paths", {}).items():
        for operation in item.values():
            responses = operation.setdefault("responses", {})
            validation = responses.get("422", {})
            if "HTTPValidationError" in json.dumps(validation):
                del responses["422"]
            statuses = [413, 500]
            if path.startswith("/v1/"):
                statuses += [401, 503]
                operation.setdefault("security", [{"bearer": []}, {}])
            for status in statuses:
                description, headers = _ERRORS[status]
                responses.setdefault(
                    str(status),
                    {
                        "description": description,
                        "content": {"application/json": {"schema": error_ref}},
                        **({"headers": headers} if headers else {}),
                    },
                )
            for response in responses.values():
                response.setdefault("headers", {})["x-request-id"] = _REQUEST_ID
    for unused in ("HTTPValidationError", "ValidationError"):
        if _REF + unused not in json.dumps(schema):
            schemas.pop(unused, None)
    return schema
