"""Gateway errors and the one function that renders them as OpenAI error bodies.

Every error a client can see is an :class:`APIError` (a branch of the tree drawn in
:mod:`cluster.errors`) with an HTTP status, an OpenAI ``type``, a ``code`` and (when one
field is at fault) a ``param``. Handlers never build error JSON by hand;
:mod:`gateway.http.openapi` documents the same errors.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.responses import JSONResponse

from cluster.errors import CharserveError
from cluster.wire.retry import retry_headers
from cluster.wire.vocabulary import DropReason, ErrorCode

ErrorType = Literal[
    "invalid_request_error", "rate_limit_error", "insufficient_quota", "server_error"
]


class APIError(CharserveError):
    """An error answered to the client."""

    status = 500
    type: ErrorType = "server_error"
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


class PermissionDenied(APIError):
    """The caller's key is valid but its tenant may not do this (403)."""

    status = 403
    type = "invalid_request_error"
    code = "permission_denied"


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


class Conflict(APIError):
    """The resource is in a state that does not allow this (409)."""

    status = 409
    type = "invalid_request_error"
    code = "conflict"


class PayloadTooLarge(APIError):
    """The body is over the configured bound (413)."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class TooManyRequests(APIError):
    """Refused for capacity or budget (429); always carries ``Retry-After``."""

    status = 429
    type = "rate_limit_error"
    code = DropReason.RATE_LIMITED.value


class QuotaExceeded(APIError):
    """The tenant stores as many of something as its limits allow (429, OpenAI's
    ``insufficient_quota``): nothing more is stored until it deletes some."""

    status = 429
    type = "insufficient_quota"
    code = "quota_exceeded"


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


def model_not_found(model: str, why: str = "") -> NotFound:
    """404 ``model_not_found`` for ``model`` (vLLM's and OpenAI's wording), with ``why``
    after it when there is more to say."""
    return NotFound(
        f"The model `{model[:200]}` does not exist{why}.", param="model", code="model_not_found"
    )


def refused(reason: DropReason, message: str, retry_after_ms: float, status: int = 429) -> APIError:
    """A refusal at the door: 429 (or 503), the drop reason, and when to come back
    (``Retry-After`` in seconds and ``retry-after-ms``, see :mod:`cluster.wire.retry`)."""
    headers = {**retry_headers(retry_after_ms), "X-Charserve-Drop-Reason": reason.value}
    if status == 503:
        return ServiceUnavailable(message, code=reason.value, headers=headers)
    return TooManyRequests(message, code=reason.value, headers=headers)


def from_worker(code: str | None, message: str | None) -> APIError:
    """Map an error chunk from a worker (its wire :class:`ErrorCode`) to the error the
    client sees."""
    text = message or "generation failed"
    if code == ErrorCode.INVALID_REQUEST:
        return BadRequest(text)
    if code == ErrorCode.EXPIRED:
        return refused(DropReason.EXPIRED, text, 1000)
    if code in (ErrorCode.LOST, ErrorCode.CANCELLED):
        return ServiceUnavailable(text, code=code, headers=retry_headers(1000))
    return APIError(text, code=code or ErrorCode.INTERNAL)
