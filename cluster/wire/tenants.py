"""Tenants: API keys and each tenant's limits, stored in Redis.

A key is shown once when it is created (``csk-<id>-<secret>``) and stored only as its
SHA-256 digest, so a Redis dump does not leak usable keys. Whether keys are needed at all is
the gateway's explicit auth mode (:data:`AuthMode`), never whether a key exists.

A tenant's :class:`Limits` are everything it may use: request and token rates (token
buckets refilled continuously, checked and taken in one Lua script so concurrent gateways
never over-admit), its weight in the queue's fair share, its caps on waiting and running
jobs, on concurrent streams, on stored objects, the classes it may use and the budgets
it may ask for. The gateway's defaults (``CHARSERVE_TENANT_LIMITS``) apply to every
tenant; ``charserve keys limits`` stores a tenant's own values, which override only the
fields they set. 0 means unlimited wherever a count or a rate is concerned.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field, field_validator

from cluster.wire.keys import Keys
from cluster.wire.vocabulary import PriorityClass

# keys: every /v1 route needs a key; open: no keys, everyone is tenant ``default`` (a
# gateway refuses to start open unless it binds to loopback only).
AuthMode = Literal["keys", "open"]
DEFAULT_TENANT = "default"

_PREFIX = "csk-"


def check_tenant_name(tenant: str) -> None:
    """Raise ``ValueError`` unless ``tenant`` is 1-64 ASCII letters, digits, '-' or '_'
    (tenant names are parts of Redis keys and of the queue's records)."""
    plain = tenant.replace("-", "").replace("_", "")
    if not 0 < len(tenant) <= 64 or not (plain.isascii() and plain.isalnum()):
        raise ValueError("a tenant name is 1-64 letters, digits, '-' or '_'")


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


class Limits(BaseModel):
    """What one tenant may use (0: unlimited, for every count and rate)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rpm: int = Field(default=0, ge=0, description="Requests per minute.")
    tpm: int = Field(default=0, ge=0, description="Tokens per minute (prompt plus max_tokens).")
    weight: float = Field(
        default=1.0, gt=0, le=1000, description="Share of the queue against other tenants."
    )
    max_waiting: int = Field(default=1_000, ge=0, description="Jobs waiting in the queue.")
    max_waiting_bytes: int = Field(
        default=64 * 1024 * 1024, ge=0, description="Bytes of the jobs waiting in the queue."
    )
    max_running: int = Field(
        default=0, ge=0, description="Jobs running on workers at once (batch slots)."
    )
    max_streams: int = Field(
        default=1_000,
        ge=0,
        description="Open replies (streams and resume readers) per gateway process.",
    )
    classes: tuple[PriorityClass, ...] = Field(
        default=tuple(PriorityClass), description="The admission classes it may use."
    )
    budget_floor_ms: dict[PriorityClass, int] = Field(
        default_factory=dict,
        description="The least X-Latency-Budget-Ms it may ask in each class.",
    )
    max_characters: int = Field(default=1_000, ge=0, description="Stored characters.")
    max_sessions: int = Field(default=10_000, ge=0, description="Stored sessions.")
    max_files: int = Field(default=100, ge=0, description="Stored files.")
    max_file_bytes: int = Field(
        default=1024 * 1024 * 1024, ge=0, description="Bytes of all its stored files."
    )
    max_batches: int = Field(default=100, ge=0, description="Batches not yet finished.")

    @field_validator("budget_floor_ms")
    @classmethod
    def _floors(cls, value: dict[PriorityClass, int]) -> dict[PriorityClass, int]:
        if any(v < 0 for v in value.values()):
            raise ValueError("budget floors are non-negative ms")
        return value

    def merged(self, own: dict[str, Any]) -> Limits:
        """These limits with a tenant's own values (the fields it set) on top."""
        return self.model_validate({**self.model_dump(), **own})


class ApiKeys:
    """Create, list, revoke and look up API keys."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys

    async def create(self, tenant: str, name: str = "") -> tuple[str, KeyRecord]:
        """A new key for ``tenant``: returns the key (shown once) and its record."""
        check_tenant_name(tenant)
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

    async def lookup(self, key: str) -> KeyRecord | None:
        """The record of ``key``, or None (unknown, revoked, or no keys at all)."""
        raw = await self._redis.hget(self._keys.api_keys, digest(key))
        return KeyRecord(**json.loads(raw)) if raw else None

    async def set_limits(self, tenant: str, limits: Limits) -> None:
        """Store a tenant's own limits: the fields ``limits`` sets explicitly, which then
        override the gateway's defaults (other fields keep following the defaults)."""
        own = limits.model_dump(mode="json", exclude_unset=True)
        await self._redis.hset(self._keys.tenant_limits, tenant, json.dumps(own))

    async def clear_limits(self, tenant: str) -> None:
        """Forget a tenant's own limits (it follows the gateway's defaults again)."""
        await self._redis.hdel(self._keys.tenant_limits, tenant)

    async def limits(self, tenant: str) -> dict[str, Any] | None:
        """The tenant's own limits (only the fields it set), if it has any."""
        raw = await self._redis.hget(self._keys.tenant_limits, tenant)
        return dict(json.loads(raw)) if raw else None


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
