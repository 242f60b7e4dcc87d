"""What every request passes before a route: its id, the body bound, and the API key.

One pure-ASGI middleware does all three, so streaming responses pay one wrapper on the
send path, not three. ``/v1`` routes need a key as soon as one exists (see
:mod:`cluster.wire.tenants`); ``/health``, ``/ready``, ``/metrics`` and the docs do not.
The tenant a key names is put in ``scope["state"]["tenant"]`` for the routes.
"""

from __future__ import annotations

import time
import uuid

import structlog
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.wire.tenants import ApiKeys, KeyRecord, Limits, RateDecision, RateLimiter, digest
from gateway.http.errors import (
    APIError,
    PayloadTooLarge,
    ServiceUnavailable,
    TooManyRequests,
    Unauthorized,
    error_response,
)

log = structlog.get_logger(__name__)

DEFAULT_TENANT = "default"
_ALLOWED_ID = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def new_request_id() -> str:
    """A fresh request id."""
    return uuid.uuid4().hex


class Authenticator:
    """Maps a bearer key to a tenant and applies the tenant's rate limits.

    Lookups are cached for ``cache_s`` (revocation takes effect within that), so an
    authenticated request costs no Redis round trip on the hot path.
    """

    def __init__(
        self,
        api_keys: ApiKeys,
        limiter: RateLimiter,
        defaults: Limits,
        cache_s: float = 2.0,
    ) -> None:
        self._api_keys = api_keys
        self._limiter = limiter
        self._defaults = defaults
        self._cache_s = cache_s
        self._records: dict[str, tuple[float, bool, KeyRecord | None]] = {}
        self._limits: dict[str, tuple[float, Limits]] = {}

    async def tenant(self, authorization: str | None) -> str:
        """The caller's tenant; 401 for a missing or unknown key once keys exist."""
        key = ""
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == "bearer":
                key = value.strip()
        now = time.monotonic()
        hashed = digest(key)
        cached = self._records.get(hashed)
        if cached is None or cached[0] < now:
            exists, record = await self._api_keys.lookup(key)
            if len(self._records) > 10_000:
                self._records.clear()
            self._records[hashed] = cached = (now + self._cache_s, exists, record)
        _, exists, record = cached
        if not exists:
            return DEFAULT_TENANT
        if record is None:
            if not key:
                raise Unauthorized(
                    "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'."
                )
            raise Unauthorized("Incorrect API key provided.")
        return record.tenant

    async def limits(self, tenant: str) -> Limits:
        """The tenant's own limits, else the gateway defaults."""
        now = time.monotonic()
        cached = self._limits.get(tenant)
        if cached is None or cached[0] < now:
            own = await self._api_keys.limits(tenant)
            cached = (now + self._cache_s, own or self._defaults)
            self._limits[tenant] = cached
        return cached[1]

    async def take(self, tenant: str, tokens: int) -> RateDecision | None:
        """Charge one request of ``tokens`` tokens; 429 with headers if over the limit."""
        limits = await self.limits(tenant)
        if not limits.rpm and not limits.tpm:
            return None
        decision = await self._limiter.take(tenant, limits, tokens)
        if decision.allowed:
            return decision
        headers = {**decision.headers(), "X-Charserve-Drop-Reason": "rate_limited"}
        if decision.wait_ms < 0:
            raise TooManyRequests(
                f"Request too large: it needs {tokens} tokens and the limit is "
                f"{limits.tpm} tokens per minute.",
                code="tokens_exceed_limit",
                headers=headers,
            )
        headers["Retry-After"] = str(max(1, -(-decision.wait_ms // 1000)))
        raise TooManyRequests(
            f"Rate limit reached for tenant {tenant}: {limits.rpm or 'unlimited'} requests and "
            f"{limits.tpm or 'unlimited'} tokens per minute. Retry after "
            f"{decision.wait_ms / 1000:.1f}s.",
            code="rate_limit_exceeded",
            headers=headers,
        )


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
                auth: Authenticator = scope["app"].state.auth
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
