"""What every request passes before a route: its id, the body bound, and the API key.

One pure-ASGI middleware does all three, so streaming responses pay one wrapper on the
send path, not three. ``/v1`` routes need a key as soon as one exists (see
:mod:`gateway.http.auth`); ``/health``, ``/ready``, ``/metrics`` and the docs do not.
The tenant a key names is put in ``scope["state"]["tenant"]`` for the routes. While
tracing is on, a request's W3C trace headers (``traceparent``, ``tracestate``) are put in
:data:`~cluster.runtime.tracing.incoming_trace` for the request's span to continue.
"""

from __future__ import annotations

import asyncio

import structlog
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.runtime.tracing import incoming_trace
from cluster.wire.retry import retry_headers
from gateway.http.auth import Authenticator, needs_key
from gateway.http.context import new_request_id
from gateway.http.errors import (
    APIError,
    BadRequest,
    PayloadTooLarge,
    ServiceUnavailable,
    error_response,
)

log = structlog.get_logger(__name__)

_ALLOWED_ID = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


class EdgeMiddleware:
    """Request ids, the body bound, and API keys, before any route runs (and the client's
    trace context, with ``trace_context``)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, trace_context: bool = False) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.trace_context = trace_context

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        # The server makes every request's id (job ids and every Redis key derive from it);
        # the client's own X-Request-Id is a label, echoed back and logged, and its
        # idempotency key within its tenant.
        request_id = new_request_id()
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        given = headers.get(b"x-request-id")
        client_id = given.decode("latin-1") if given is not None else None
        state["client_request_id"] = client_id
        echo = (client_id if client_id is not None and _sane(given) else request_id).encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                message["headers"] = [*kept, (b"x-request-id", echo)]
            await send(message)

        if given is not None and not _sane(given):
            bad = BadRequest(
                "X-Request-Id is 1-128 characters: letters, digits, '-', '_' or '.'",
                param="X-Request-Id",
            )
            await _refuse(bad, request_id, scope, receive, send_with_id)
            return
        try:
            receive = await self._bounded(headers, receive)
            if needs_key(scope["path"]):
                auth: Authenticator = scope["app"].state.services.auth
                state["tenant"] = await auth.tenant(
                    headers.get(b"authorization", b"").decode("latin-1") or None
                )
        except APIError as exc:
            await _refuse(exc, request_id, scope, receive, send_with_id)
            return
        except RedisError as exc:
            log.warning("auth unavailable", error=str(exc), request_id=request_id)
            error = ServiceUnavailable("authentication is unavailable", headers=retry_headers(1000))
            await _refuse(error, request_id, scope, receive, send_with_id)
            return
        parent = headers.get(b"traceparent") if self.trace_context else None
        if parent is None:
            await self.app(scope, receive, send_with_id)
            return
        carrier = {"traceparent": parent.decode("latin-1")}
        state_header = headers.get(b"tracestate")
        if state_header is not None:
            carrier["tracestate"] = state_header.decode("latin-1")
        token = incoming_trace.set(carrier)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            incoming_trace.reset(token)

    async def _bounded(self, headers: dict[bytes, bytes], receive: Receive) -> Receive:
        """413 for a body over the bound. A declared length is checked at once; a chunked
        body is read (up to the bound) here and replayed to the route."""
        declared = headers.get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
            return receive
        if b"chunked" not in headers.get(b"transfer-encoding", b""):
            return receive
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replayed = {"type": "http.request", "body": b"".join(parts), "more_body": False}
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return replayed
            return await receive()

        return replay


# A refusal at the edge first reads (and drops) what the client still sends of its body,
# up to these bounds: a server that answers and closes with unread data in the socket
# resets the connection, and the client never sees its 413 or 401.
DRAIN_MAX_BYTES = 256 * 1024 * 1024
DRAIN_MAX_S = 15.0


async def _drain(receive: Receive) -> bool:
    """Read the rest of the request body (bounded); True if it all arrived."""
    read = 0
    try:
        async with asyncio.timeout(DRAIN_MAX_S):
            while read <= DRAIN_MAX_BYTES:
                message = await receive()
                if message["type"] != "http.request":
                    return False
                read += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return True
    except TimeoutError:
        pass
    return False


async def _refuse(
    error: APIError, request_id: str, scope: Scope, receive: Receive, send: Send
) -> None:
    """Answer ``error`` before any route ran, so that the client reads it."""
    drained = await _drain(receive)
    response = error_response(error, request_id)
    if not drained:
        response.headers["connection"] = "close"
    await response(scope, receive, send)


def _sane(given: bytes | None) -> bool:
    return given is not None and 0 < len(given) <= 128 and set(given) <= _ALLOWED_ID


def _too_large(bound: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the request body is over {bound} bytes")
