"""The OpenAPI document says what the gateway answers, errors included.

:func:`error_responses` documents error statuses with the :class:`ErrorBody` model for a
route's ``responses=``, and :func:`document_errors` adds the errors every route can meet at
the edge and drops FastAPI's 422, which this gateway never answers (validation errors are
400).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from cluster.wire.vocabulary import DropReason
from gateway.http.auth import needs_key
from gateway.http.errors import ErrorType


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
_RETRY_AFTER_MS = {
    "description": "Milliseconds to wait before retrying (read first by the openai SDK).",
    "schema": _INT,
}
_DROP_REASON = {
    "description": "Why the request was refused at the door.",
    "schema": {
        "type": "string",
        "enum": [r.value for r in DropReason],
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
    403: ("The tenant's limits do not allow this (a class it may not use).", {}),
    404: ("Unknown model, or no such resource for this tenant.", {}),
    409: ("The resource is in a state that does not allow this.", {}),
    413: ("The request body is over the configured bound.", {}),
    429: (
        "Refused: over the latency budget, queue full, rate limited, or expired.",
        {
            "Retry-After": _RETRY_AFTER,
            "retry-after-ms": _RETRY_AFTER_MS,
            "X-Charserve-Drop-Reason": _DROP_REASON,
        }
        | _RATE_LIMIT_HEADERS,
    ),
    500: ("Internal error.", {}),
    503: (
        "No worker, or a dependency (Redis) is unavailable.",
        {
            "Retry-After": _RETRY_AFTER,
            "retry-after-ms": _RETRY_AFTER_MS,
            "X-Charserve-Drop-Reason": _DROP_REASON,
        },
    ),
    504: ("No reply from any worker in time.", {}),
}


def ok(model: type[BaseModel], description: str) -> dict[int | str, dict[str, Any]]:
    """``responses=`` documentation of a 200 answered with ``model``."""
    return {200: {"model": model, "description": description}}


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
            if needs_key(path):
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
