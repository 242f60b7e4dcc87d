"""Gateway errors and the one function that renders them as OpenAI error bodies.

Every error a client can see is an :class:`APIError` with an HTTP status, an OpenAI
``type``, a ``code`` and (when one field is at fault) a ``param``. Handlers never build
error JSON by hand.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


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


def error_response(exc: APIError, request_id: str | None = None) -> JSONResponse:
    """Render ``exc`` as a JSON response with its status and headers."""
    headers = dict(exc.headers)
    if request_id:
        headers["x-request-id"] = request_id
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


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
