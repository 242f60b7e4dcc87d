"""What every request passes before a route: its id, the body bound, and the API key.

One pure-ASGI middleware does all three, so streaming responses pay one wrapper on the
send path, not three. ``/v1`` routes need a key as soon as one exists (see
:mod:`gateway.http.auth`); ``/health``, ``/ready``, ``/metrics`` and the docs do not.
The tenant a key names is put in ``scope["state"]["tenant"]`` for the routes.
"""

from __future__ import annotations

import structlog
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.http.auth import Authenticator
from gateway.http.context import new_request_id
from gateway.http.errors import APIError, PayloadTooLarge, ServiceUnavailable, error_response

log = structlog.get_logger(__name__)

_ALLOWED_ID = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


class EdgeMiddleware:
    """Request ids, the body bound, and API keys, before any route runs."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"")
        ok = 0 < len(given) <= 128 and set(given) <= _ALLOWED_ID
        request_id = given.decode() if ok else new_request_id()
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        raw_id = request_id.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                message["headers"] = [*kept, (b"x-request-id", raw_id)]
            await send(message)

        try:
            receive = await self._bounded(headers, receive)
            if scope["path"].startswith("/v1/") or scope["path"] == "/v1":
                auth: Authenticator = scope["app"].state.services.auth
                state["tenant"] = await auth.tenant(
                    headers.get(b"authorization", b"").decode("latin-1") or None
                )
        except APIError as exc:
            await error_response(exc, request_id)(scope, receive, send_with_id)
            return
        except RedisError as exc:
            log.warning("auth unavailable", error=str(exc), request_id=request_id)
            error = ServiceUnavailable(
                "authentication is unavailable", headers={"Retry-After": "1"}
            )
            await error_response(error, request_id)(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)

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


def _too_large(bound: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the request body is over {bound} bytes")
