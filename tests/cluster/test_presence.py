"""Liveness records (cluster/wire/presence.py): written even past ``maxmemory``, and the
workers set keeps no worker silent for an hour."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from cluster.runtime.clock import RedisClock
from cluster.runtime.redis_server import RedisServer
from cluster.wire.keys import Keys
from cluster.wire.presence import Presence


async def test_a_beat_records_the_worker_and_returns_redis_time(
    redis: aioredis.Redis, keys: Keys
) -> None:
    before = RedisClock.from_time_reply(await redis.time())
    now = await Presence(redis).beat(
        keys.workers, keys.worker_stats("w1"), "w1", b"stats", 5000, before
    )
    after = RedisClock.from_time_reply(await redis.time())
    assert before <= now <= after
    assert await redis.zscore(keys.workers, "w1") == before
    assert await redis.get(keys.worker_stats("w1")) == b"stats"
    assert 0 < await redis.pttl(keys.worker_stats("w1")) <= 5000
    # Stats alone (between beats) leave the score where it was.
    await Presence(redis).beat(keys.workers, keys.worker_stats("w1"), "w1", b"new", 5000, None)
    assert await redis.zscore(keys.workers, "w1") == before
    assert await redis.get(keys.worker_stats("w1")) == b"new"


async def test_workers_silent_for_an_hour_leave_the_set(redis: aioredis.Redis, keys: Keys) -> None:
    now = RedisClock.from_time_reply(await redis.time())
    await redis.zadd(keys.workers, {"killed": now - 3_600_001, "quiet": now - 3_000_000})
    await Presence(redis).beat(keys.workers, keys.worker_stats("w2"), "w2", b"s", 5000, now)
    assert await redis.zrange(keys.workers, 0, -1) == [b"quiet", b"w2"]


async def test_the_records_go_through_a_full_redis() -> None:
    with RedisServer() as server:
        redis = aioredis.Redis.from_url(server.url)
        try:
            keys = Keys("full")
            await redis.config_set("maxmemory", 1)  # below anything: every plain write fails
            with pytest.raises(aioredis.ResponseError, match="maxmemory"):
                await redis.set(keys.gateway_alive("g1"), b"1", px=10_000)
            presence = Presence(redis)
            await presence.announce(keys.gateway_alive("g1"), 10_000)
            now = RedisClock.from_time_reply(await redis.time())
            await presence.beat(keys.workers, keys.worker_stats("w1"), "w1", b"s", 5000, now)
            assert await redis.exists(keys.gateway_alive("g1"), keys.worker_stats("w1")) == 2
            assert await redis.zscore(keys.workers, "w1") == now
        finally:
            await redis.aclose()
