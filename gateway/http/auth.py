"""API keys to tenants, and each tenant's rate limits, as the edge checks them.

While no key exists the gateway is open and every caller is the tenant ``default`` (the
laptop case); once one exists, every ``/v1`` route needs ``Authorization: Bearer <key>``.
Keys and limits are stored in Redis (:mod:`cluster.wire.tenants`).
"""

from __future__ import annotations

import time

from cluster.wire.tenants import ApiKeys, KeyRecord, Limits, RateDecision, RateLimiter, digest
from cluster.wire.vocabulary import DropReason
from gateway.http.errors import TooManyRequests, Unauthorized

DEFAULT_TENANT = "default"


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
        headers = {**decision.headers(), "X-Charserve-Drop-Reason": DropReason.RATE_LIMITED}
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
