"""The exception handlers: every error a route raises, FastAPI's validation errors and
Starlette's HTTP errors included, leaves as an OpenAI error body with ``x-request-id``."""

from __future__ import annotations

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import OutOfMemoryError, RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.wire.retry import retry_headers
from gateway.http.context import request_id
from gateway.http.errors import APIError, BadRequest, ServiceUnavailable, error_response

log = structlog.get_logger(__name__)


def validation_error(exc: RequestValidationError) -> APIError:
    """A 400 naming the first field at fault (FastAPI would answer 422)."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return BadRequest(
            f"the body is not valid JSON: {first.get('msg', '')}", code="invalid_json"
        )
    if not loc and kind in ("model_attributes_type", "dict_type", "missing"):
        return BadRequest("the body must be a JSON object", code="invalid_json")
    ctx = first.get("ctx") or {}
    message = first.get("msg", "invalid request")
    if "field" in ctx:  # a refused or unknown field: named by its full path
        return BadRequest(
            message, param=".".join([*loc, str(ctx["field"])]), code="unsupported_field"
        )
    param = ".".join(loc) or ctx.get("param") or None
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problems)"
    return BadRequest(message, param=param, code="invalid_value")


def http_error(exc: StarletteHTTPException) -> APIError:
    """Starlette's own 404, 405 and body errors as API errors."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    if code is None and exc.status_code < 500:
        code = "invalid_request"  # e.g. a body FastAPI cannot parse, a bad multipart form
    # exc.headers: e.g. the Allow header a 405 must carry.
    error = APIError(str(exc.detail), code=code, headers=dict(exc.headers or {}))
    error.status = exc.status_code
    error.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error


def redis_unavailable(exc: RedisError) -> APIError:
    """Redis did not answer, or refused to store more (over its ``maxmemory``): 503 with
    ``Retry-After``; nothing was written (every multi-step write is one script, which a
    full Redis refuses whole)."""
    if isinstance(exc, OutOfMemoryError):
        log.warning("redis is full", error=str(exc))
        return ServiceUnavailable(
            "the service's storage is full; try again later",
            code="storage_full",
            headers=retry_headers(5000),
        )
    log.warning("redis unavailable", error=str(exc))
    return ServiceUnavailable("a dependency (Redis) is unavailable", headers=retry_headers(1000))


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers on ``app``."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request_id(request))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc), request_id(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(http_error(exc), request_id(request))

    @app.exception_handler(RedisError)
    async def _redis(request: Request, exc: RedisError) -> JSONResponse:
        return error_response(redis_unavailable(exc), request_id(request))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", request_id=request_id(request))
        return error_response(APIError("internal error"), request_id(request))
