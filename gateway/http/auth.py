"""API keys to tenants, and each tenant's limits, as the edge checks them.

The auth mode is explicit (``CHARSERVE_AUTH``): with ``keys`` every ``/v1`` route needs
``Authorization: Bearer <key>``, and a key table that is empty or gone (a Redis restarted
without its data, the last key revoked, a mistyped namespace) means 401 for everyone, never
an open door. ``open`` (no keys: every caller is the tenant ``default``) is for a gateway
bound to loopback only; it refuses to start on any other address. Keys and limits are
stored in Redis (:mod:`cluster.wire.tenants`).
"""

from __future__ import annotations

import ipaddress
import time

from cluster.errors import ConfigError
from cluster.wire.retry import retry_headers
from cluster.wire.tenants import (
    DEFAULT_TENANT,
    ApiKeys,
    AuthMode,
    KeyRecord,
    Limits,
    RateDecision,
    RateLimiter,
    digest,
)
from cluster.wire.vocabulary import DropReason
from gateway.http.errors import TooManyRequests, Unauthorized

__all__ = ["DEFAULT_TENANT", "Authenticator", "check_auth_mode"]


def is_loopback(host: str) -> bool:
    """True for a bind address that only this machine reaches."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_auth_mode(mode: AuthMode, host: str) -> None:
    """Refuse an open gateway on an address other machines reach."""
    if mode == "open" and not is_loopback(host):
        raise ConfigError(
            f"CHARSERVE_AUTH=open serves anyone as one tenant: it binds to loopback only, "
            f"not {host!r}; set CHARSERVE_AUTH=keys (and create keys with `charserve keys "
            "create`), or CHARSERVE_HOST=127.0.0.1"
        )


class Authenticator:
    """Maps a bearer key to a tenant and gives each tenant its limits.

    Lookups are cached for ``cache_s`` (revocation takes effect within that), so an
    authenticated request costs no Redis round trip on the hot path.
    """

    def __init__(
        self,
        mode: AuthMode,
        api_keys: ApiKeys,
        limiter: RateLimiter,
        defaults: Limits,
        cache_s: float = 2.0,
    ) -> None:
        self.mode: AuthMode = mode
        self._api_keys = api_keys
        self._limiter = limiter
        self._defaults = defaults
        self._cache_s = cache_s
        self._records: dict[str, tuple[float, KeyRecord | None]] = {}
        self._limits: dict[str, tuple[float, Limits]] = {}

    async def tenant(self, authorization: str | None) -> str:
        """The caller's tenant; 401 for a missing or unknown key (in ``keys`` mode)."""
        if self.mode == "open":
            return DEFAULT_TENANT
        key = ""
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == "bearer":
                key = value.strip()
        if not key:
            raise Unauthorized(
                "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'."
            )
        now = time.monotonic()
        hashed = digest(key)
        cached = self._records.get(hashed)
        if cached is None or cached[0] < now:
            record = await self._api_keys.lookup(key)
            if len(self._records) > 10_000:
                self._records.clear()
            self._records[hashed] = cached = (now + self._cache_s, record)
        record = cached[1]
        if record is None:
            raise Unauthorized("Incorrect API key provided.")
        return record.tenant

    async def limits(self, tenant: str) -> Limits:
        """The tenant's own limits, else the gateway defaults."""
        now = time.monotonic()
        cached = self._limits.get(tenant)
        if cached is None or cached[0] < now:
            own = await self._api_keys.limits(tenant)
            cached = (now + self._cache_s, self._defaults.merged(own) if own else self._defaults)
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
        headers = {**decision.headers(), "X-Charserve-Drop-Reason": DropReason.RATE_LIMITED}
        if decision.wait_ms < 0:
            raise TooManyRequests(
                f"Request too large: it needs {tokens} tokens and the limit is "
                f"{limits.tpm} tokens per minute.",
                code="tokens_exceed_limit",
                headers=headers,
            )
        headers.update(retry_headers(decision.wait_ms))
        raise TooManyRequests(
            f"Rate limit reached for tenant {tenant}: {limits.rpm or 'unlimited'} requests and "
            f"{limits.tpm or 'unlimited'} tokens per minute. Retry after "
            f"{decision.wait_ms / 1000:.1f}s.",
            code="rate_limit_exceeded",
            headers=headers,
        )


# Routes outside /v1 that spend the service's work (vLLM's paths for them): keyed as /v1.
_KEYED_PATHS = frozenset({"/tokenize", "/detokenize"})


def needs_key(path: str) -> bool:
    """True for a route answered only to a tenant (the API key check applies)."""
    return path.startswith("/v1/") or path == "/v1" or path in _KEYED_PATHS
