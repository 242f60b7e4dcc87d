"""Liveness records in Redis: a gateway's presence key and a worker's heartbeat.

Both are written by scripts flagged ``allow-oom``. A Redis at its ``maxmemory``
(``noeviction``) refuses every plain write, and a liveness record that cannot be refreshed
expires: workers then drop the streams of a gateway that looks gone, and gateways refuse
every request for want of workers and report themselves not ready. So whoever fills Redis
(one tenant's quota is bounded; several tenants, or another application sharing the server,
are not) would end the work already accepted for everyone. New work is still refused while
Redis is full (``storage_full``); what runs keeps running.

Each record replaces one of a bounded size per process (one member of the workers set, one
stats record, one presence key), so letting it through a full Redis grows memory by a few
hundred bytes a live process at most: a beat also drops the members of workers silent for
an hour.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from cluster.wire.queue import ALLOW_OOM, NOW_MS_LUA

# KEYS: 1 the key. ARGV: 1 its value, 2 its TTL (ms).
_ANNOUNCE = (
    ALLOW_OOM
    + """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
)

# KEYS: 1 the workers set, 2 this worker's stats record. ARGV: 1 its score (the beat's time
# in ms; empty: leave the score, only the stats changed), 2 the worker's id, 3 the encoded
# stats, 4 their TTL (ms). Returns Redis's time in ms, for the worker's clock.
_BEAT = (
    ALLOW_OOM
    + NOW_MS_LUA
    + """
if ARGV[1] ~= '' then
  redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
  -- Workers that stopped without leaving (killed, lost with their node) go after an hour:
  -- readers only look at fresh beats, and restarts must not grow the set without bound.
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - 3600000))
end
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])
return now
"""
)


class Presence:
    """Writes one process's liveness records, even into a full Redis."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._announce = redis.register_script(_ANNOUNCE)
        self._beat = redis.register_script(_BEAT)

    async def announce(self, key: str, ttl_ms: int, value: bytes = b"1") -> None:
        """Set ``key`` to ``value`` for ``ttl_ms`` (a gateway's presence)."""
        await self._announce(keys=[key], args=[value, ttl_ms])

    async def beat(
        self,
        workers_key: str,
        stats_key: str,
        worker_id: str,
        stats: bytes,
        ttl_ms: int,
        ts_ms: int | None,
    ) -> int:
        """Record a worker's beat: its score ``ts_ms`` in the workers set (None: leave it)
        and its ``stats`` for ``ttl_ms``. Returns Redis's time in ms."""
        now_ms = await self._beat(
            keys=[workers_key, stats_key],
            args=["" if ts_ms is None else ts_ms, worker_id, stats, ttl_ms],
        )
        return int(now_ms)
