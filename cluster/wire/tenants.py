"""Tenants: API keys and per-tenant rate limits, stored in Redis.

A key is shown once when it is created (``csk-<id>-<secret>``) and stored only as its
SHA-256 digest, so a Redis dump does not leak usable keys. While no key exists the gateway
is open and every caller is the tenant ``default`` (the laptop case); once one exists,
every ``/v1`` route needs ``Authorization: Bearer <key>``.

Limits are token buckets refilled continuously (requests and tokens per minute), checked
and taken in one Lua script so concurrent gateways never over-admit. A tenant's own limits
(``charserve keys limits``) override the gateway's defaults; 0 means unlimited.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis

from cluster.wire.keys import Keys

_PREFIX = "csk-"


def digest(key: str) -> str:
    """The stored form of an API key."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """What is stored about one key (never the key itself)."""

    id: str
    tenant: str
    created: int
    name: str = ""


@dataclass(frozen=True, slots=True)
class Limits:
    """Requests and tokens per minute; 0 = unlimited."""

    rpm: int = 0
    tpm: int = 0


class ApiKeys:
    """Create, list, revoke and look up API keys."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys

    async def create(self, tenant: str, name: str = "") -> tuple[str, KeyRecord]:
        """A new key for ``tenant``: returns the key (shown once) and its record."""
        if not tenant or len(tenant) > 64 or not tenant.replace("-", "").replace("_", "").isalnum():
            raise ValueError("a tenant name is 1-64 letters, digits, '-' or '_'")
        key_id = secrets.token_hex(4)
        key = f"{_PREFIX}{key_id}-{secrets.token_urlsafe(32)}"
        record = KeyRecord(key_id, tenant, int(time.time()), name)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._keys.api_keys, digest(key), json.dumps(asdict(record)))
            pipe.hset(self._keys.api_key_ids, key_id, digest(key))
            await pipe.execute()
        return key, record

    async def list(self) -> list[KeyRecord]:
        """Every key's record, oldest first."""
        raw = await self._redis.hvals(self._keys.api_keys)
        return sorted((KeyRecord(**json.loads(r)) for r in raw), key=lambda r: r.created)

    async def revoke(self, key_id: str) -> bool:
        """Revoke one key by id; False if there is no such key."""
        hashed = await self._redis.hget(self._keys.api_key_ids, key_id)
        if hashed is None:
            return False
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self._keys.api_keys, hashed)
            pipe.hdel(self._keys.api_key_ids, key_id)
            await pipe.execute()
        return True

    async def lookup(self, key: str) -> tuple[bool, KeyRecord | None]:
        """(any key exists, the record of ``key`` or None), in one round trip."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hlen(self._keys.api_keys)
            pipe.hget(self._keys.api_keys, digest(key))
            count, raw = await pipe.execute()
        record = KeyRecord(**json.loads(raw)) if raw else None
        return bool(count), record

    async def set_limits(self, tenant: str, limits: Limits) -> None:
        """Override the default limits for one tenant."""
        await self._redis.hset(self._keys.tenant_limits, tenant, json.dumps(asdict(limits)))

    async def limits(self, tenant: str) -> Limits | None:
        """The tenant's own limits, if it has any."""
        raw = await self._redis.hget(self._keys.tenant_limits, tenant)
        return Limits(**json.loads(raw)) if raw else None


# Two token buckets in one hash: r/rt = request level and its time, t/tt = tokens.
# Levels refill at limit/60000 per ms up to the limit. Both must cover the request, or
# nothing is taken and the script says how long to wait. A request needing more tokens
# than a whole minute's allowance can never pass (wait -1).
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local need = tonumber(ARGV[3])
local s = redis.call('HMGET', KEYS[1], 'r', 'rt', 't', 'tt')
local function level(cap, v, ts)
  if not v then return cap end
  local l = tonumber(v) + (now - tonumber(ts)) * cap / 60000
  if l > cap then l = cap end
  return l
end
local r = level(rpm, s[1], s[2])
local tk = level(tpm, s[3], s[4])
local wait = 0
if rpm > 0 and r < 1 then wait = math.ceil((1 - r) * 60000 / rpm) end
if tpm > 0 and tk < need then
  if need > tpm then return {-1, math.floor(r), math.floor(tk), 0, 0} end
  wait = math.max(wait, math.ceil((need - tk) * 60000 / tpm))
end
if wait == 0 then
  if rpm > 0 then r = r - 1 end
  if tpm > 0 then tk = tk - need end
  redis.call('HSET', KEYS[1], 'r', tostring(r), 'rt', now, 't', tostring(tk), 'tt', now)
  redis.call('PEXPIRE', KEYS[1], 120000)
end
local reset_r = 0
if rpm > 0 then reset_r = math.ceil((rpm - r) * 60000 / rpm) end
local reset_t = 0
if tpm > 0 then reset_t = math.ceil((tpm - tk) * 60000 / tpm) end
return {wait, math.floor(r), math.floor(tk), reset_r, reset_t}
"""


@dataclass(frozen=True, slots=True)
class RateDecision:
    """The outcome of one take: ``wait_ms`` 0 = allowed, -1 = can never fit."""

    limits: Limits
    wait_ms: int
    remaining_requests: int
    remaining_tokens: int
    reset_requests_ms: int
    reset_tokens_ms: int

    @property
    def allowed(self) -> bool:
        """True if the request was admitted (and its share taken)."""
        return self.wait_ms == 0

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the limits that apply."""
        out: dict[str, str] = {}
        if self.limits.rpm:
            out["x-ratelimit-limit-requests"] = str(self.limits.rpm)
            out["x-ratelimit-remaining-requests"] = str(max(self.remaining_requests, 0))
            out["x-ratelimit-reset-requests"] = f"{self.reset_requests_ms / 1000:.3g}s"
        if self.limits.tpm:
            out["x-ratelimit-limit-tokens"] = str(self.limits.tpm)
            out["x-ratelimit-remaining-tokens"] = str(max(self.remaining_tokens, 0))
            out["x-ratelimit-reset-tokens"] = f"{self.reset_tokens_ms / 1000:.3g}s"
        return out


class RateLimiter:
    """Atomic per-tenant request and token buckets."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys
        self._take = redis.register_script(_TAKE)

    async def take(self, tenant: str, limits: Limits, tokens: int) -> RateDecision:
        """Take one request and ``tokens`` tokens from ``tenant``'s buckets if both allow."""
        wait, req, tok, reset_r, reset_t = await self._take(
            keys=[self._keys.rate(tenant)], args=[limits.rpm, limits.tpm, tokens]
        )
        return RateDecision(limits, int(wait), int(req), int(tok), int(reset_r), int(reset_t))
