"""A stopping replica (scale-down, rolling update) loses no reply: what it hands back is
continued by another replica even when the reply's time-to-first-token deadline has long
passed, since the first token met it on the first replica."""

from __future__ import annotations

import redis.asyncio as aioredis

from cluster.wire.keys import Keys
from cluster.wire.queue import JobQueue
from tests.fakes import FakeEngine
from tests.workers.test_consumer import Inbox, make_job
from workers.loop.config import ConsumerConfig
from workers.loop.consumer import Consumer

FAST = ConsumerConfig(lease_ms=300, heartbeat_ms=50, drain_timeout_s=0.1)


async def test_a_reply_handed_back_past_its_deadline_is_continued_not_expired(
    redis_url: str, redis: aioredis.Redis, keys: Keys
) -> None:
    stopping = Consumer(redis_url, keys, FakeEngine(max_slots=2, delay_s=0.02), FAST)
    await stopping.start()
    queue = JobQueue(redis, keys)
    async with Inbox(redis, keys.inbox("g")) as inbox:
        # A 200 ms budget: met by the first token, long past when the replica stops.
        await queue.enqueue(make_job("long", inbox.channel, max_tokens=60, budget_ms=200))
        await inbox.wait_until(lambda: len(inbox.chunks.get("long", [])) >= 15)
        await stopping.close()  # 0.1 s of drain is not enough: handed back
        assert not inbox.chunks["long"][-1].is_final
        engine = FakeEngine(max_slots=2)
        other = Consumer(redis_url, keys, engine, FAST.model_copy(update={"drain_timeout_s": 5}))
        await other.start()
        chunks = await inbox.final("long")
        await other.close()
    assert chunks[-1].error_code is None and chunks[-1].finish_reason == "length"
    assert "".join(c.text for c in chunks) == "".join(f" t{i}" for i in range(60))
    assert engine.jobs["long"].attempt == 0 and engine.jobs["long"].resume_seq > 0
