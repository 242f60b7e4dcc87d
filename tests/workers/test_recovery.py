"""No accepted job is lost: orphans are taken over and continued seamlessly, repeated
failures end in the dead-letter list, and batch work leaves headroom."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from cluster.wire.keys import Keys
from cluster.wire.protocol import Job
from cluster.wire.queue import JobQueue
from tests.fakes import FakeEngine
from tests.workers.test_consumer import Inbox, make_job
from workers.loop.config import ConsumerConfig
from workers.loop.consumer import Consumer
from workers.loop.publisher import Publisher, RequestStream

FAST = ConsumerConfig(lease_ms=300, heartbeat_ms=50, max_attempts=3, batch_reserve_slots=2)


def expected(n: int) -> str:
    return "".join(f" t{i}" for i in range(n))


async def ghost_delivers(
    redis: aioredis.Redis, keys: Keys, queue: JobQueue, job_id: str, tokens: int
) -> None:
    """Play a worker that claims a job, streams ``tokens`` tokens, then dies silently."""
    [job] = (await queue.claim("ghost", 1, lease_ms=200)).jobs
    assert isinstance(job, Job) and job.id == job_id
    publisher = Publisher(redis, keys, worker_id="ghost")
    await publisher.start()
    stream = RequestStream(job=job, worker_id="ghost", queue_ms=0.0)
    for i in range(tokens):
        stream.pending_text.append(f" t{i}")
        stream.pending_ids.append(i)
        stream.completion_tokens += 1
        publisher.mark(stream)
        await publisher.flush()
    await publisher.close()


@pytest.fixture
async def live(redis_url: str, keys: Keys) -> AsyncIterator[tuple[Consumer, FakeEngine]]:
    engine = FakeEngine(max_slots=4)
    consumer = Consumer(redis_url, keys, engine, FAST)
    yield consumer, engine
    engine.release.set()
    await consumer.close()


async def test_orphan_continues_seamlessly_on_a_live_worker(
    redis: aioredis.Redis, keys: Keys, live: tuple[Consumer, FakeEngine]
) -> None:
    consumer, engine = live
    queue = JobQueue(redis, keys)
    async with Inbox(redis, keys.inbox("g")) as inbox:
        await queue.enqueue(make_job("orphan", inbox.channel, max_tokens=12, budget_ms=50))
        await ghost_delivers(redis, keys, queue, "orphan", tokens=5)
        await consumer.start()  # only now is a live worker around to notice the lease expire
        chunks = await inbox.final("orphan")
    assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))
    assert "".join(c.text for c in chunks) == expected(12)  # nothing twice, nothing missing
    assert chunks[-1].completion_tokens == 12 and chunks[-1].finish_reason == "length"
    assert chunks[-1].worker_id == consumer.worker_id
    assert engine.jobs["orphan"].attempt == 1
    assert engine.jobs["orphan"].resume_token_ids == [0, 1, 2, 3, 4]


async def test_repeated_failure_is_dead_lettered_with_an_error(
    redis: aioredis.Redis, keys: Keys, live: tuple[Consumer, FakeEngine]
) -> None:
    consumer, engine = live
    queue = JobQueue(redis, keys)
    async with Inbox(redis, keys.inbox("g")) as inbox:
        job = dataclasses.replace(make_job("doomed", inbox.channel), attempt=2)
        await queue.enqueue(job)
        await ghost_delivers(redis, keys, queue, "doomed", tokens=2)
        await consumer.start()
        chunks = await inbox.final("doomed")
    assert chunks[-1].error_code == "dead_letter" and chunks[-1].seq == 3
    assert "doomed" not in engine.started
    assert len(await redis.lrange(keys.dead, 0, -1)) == 1
    assert not await redis.hexists(keys.jobs, "doomed")


async def test_poison_body_does_not_block_the_queue(
    redis: aioredis.Redis, keys: Keys, live: tuple[Consumer, FakeEngine]
) -> None:
    consumer, _ = live
    await redis.hset(keys.jobs, "poison", b"\xc1garbage")
    await redis.zadd(keys.queue, {"poison": 0})
    queue = JobQueue(redis, keys)
    async with Inbox(redis, keys.inbox("g")) as inbox:
        await queue.enqueue(make_job("next", inbox.channel))
        await consumer.start()
        assert "".join(c.text for c in await inbox.final("next")) == expected(3)
    assert await redis.lrange(keys.dead, 0, -1) == [b"\xc1garbage"]


async def test_batch_work_leaves_headroom_for_interactive(
    redis: aioredis.Redis, keys: Keys, live: tuple[Consumer, FakeEngine]
) -> None:
    consumer, engine = live
    engine.release.clear()
    queue = JobQueue(redis, keys)
    async with Inbox(redis, keys.inbox("g")) as inbox:
        for i in range(4):
            batch = dataclasses.replace(make_job(f"b{i}", inbox.channel), priority_class="batch")
            await queue.enqueue(dataclasses.replace(batch, deadline_ms=batch.arrival_ms + 10**8))
        await consumer.start()
        await engine.wait_until(lambda: engine.running == 2)  # 4 slots - 2 reserved
        await queue.enqueue(make_job("live", inbox.channel))
        await engine.wait_until(lambda: "live" in engine.started)
        assert engine.running == 3
        engine.release.set()
        for job_id in ("live", "b0", "b1", "b2", "b3"):
            await inbox.final(job_id)


async def test_shutdown_hands_unfinished_work_back(
    redis_url: str, redis: aioredis.Redis, keys: Keys
) -> None:
    slow = FakeEngine(max_slots=2, delay_s=0.01)
    first = Consumer(redis_url, keys, slow, FAST.model_copy(update={"drain_timeout_s": 0.1}))
    await first.start()
    queue = JobQueue(redis, keys)
    async with Inbox(redis, keys.inbox("g")) as inbox:
        await queue.enqueue(make_job("long", inbox.channel, max_tokens=200))
        await inbox.wait_until(lambda: len(inbox.chunks.get("long", [])) >= 3)
        await first.close()  # 0.1 s of drain is not enough for 200 tokens
        assert not (inbox.chunks["long"][-1].is_final)
        second_engine = FakeEngine(max_slots=2)
        second = Consumer(redis_url, keys, second_engine, FAST)
        await second.start()
        chunks = await inbox.final("long")
        await second.close()
    assert "".join(c.text for c in chunks) == expected(200)
    assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))
    assert second_engine.jobs["long"].attempt == 0  # a hand-back is not a failure
