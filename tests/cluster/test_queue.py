"""The Redis queue against a real redis-server: order, leases, cancellation, wake-up."""

from __future__ import annotations

import asyncio
import dataclasses

import redis.asyncio as aioredis

from cluster.runtime.redis_client import connect
from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import Cancel, Job
from cluster.wire.queue import JobQueue, Poison


def job(job_id: str, arrival_ms: int, deadline_ms: int) -> Job:
    return Job(
        id=job_id,
        reply_to="inbox",
        model="m",
        prompt_token_ids=[1],
        max_tokens=1,
        sampling={},
        arrival_ms=arrival_ms,
        deadline_ms=deadline_ms,
    )


async def test_edf_claims_earliest_deadline_first(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys, "edf")
    await queue.enqueue(job("late", arrival_ms=1, deadline_ms=900))
    await queue.enqueue(job("urgent", arrival_ms=2, deadline_ms=100))
    await queue.enqueue(job("middle", arrival_ms=3, deadline_ms=500))
    claimed = await queue.claim("w1", 10, lease_ms=1000)
    assert [j.id for j in claimed] == ["urgent", "middle", "late"]


async def test_fifo_claims_in_arrival_order(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys, "fifo")
    await queue.enqueue(job("first", arrival_ms=1, deadline_ms=900))
    await queue.enqueue(job("second", arrival_ms=2, deadline_ms=100))
    assert [j.id for j in await queue.claim("w1", 10, lease_ms=1000)] == ["first", "second"]


async def test_claim_takes_at_most_what_was_asked(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys)
    for i in range(5):
        await queue.enqueue(job(f"j{i}", i, 100 + i))
    assert len(await queue.claim("w1", 2, lease_ms=1000)) == 2
    assert await queue.claim("w1", 0, lease_ms=1000) == []
    stats = await queue.stats()
    assert (stats.waiting, stats.claimed) == (3, 2)


async def test_duplicate_id_is_not_queued_twice(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys)
    assert await queue.enqueue(job("same", 1, 10))
    assert not await queue.enqueue(job("same", 2, 5))
    assert (await queue.stats()).waiting == 1


async def test_ack_and_renew_belong_to_the_lease_holder(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys)
    await queue.enqueue(job("a", 1, 10))
    await queue.enqueue(job("b", 2, 20))
    await queue.claim("w1", 2, lease_ms=1000)
    assert await queue.renew("w2", ["a"], lease_ms=5000) == ["a"]
    assert await queue.renew("w1", ["a", "b"], lease_ms=5000) == []
    assert not await queue.ack("a", "w2")
    assert await queue.ack("a", "w1")
    assert not await queue.ack("a", "w1")
    stats = await queue.stats()
    assert (stats.waiting, stats.claimed) == (0, 1)
    assert await redis.hexists(keys.jobs, "b")
    assert not await redis.hexists(keys.jobs, "a")


async def test_lease_expiry_is_recorded_in_redis_time(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys)
    await queue.enqueue(job("a", 1, 10))
    seconds, micros = await redis.time()
    await queue.claim("w1", 1, lease_ms=7000)
    expiry = await redis.zscore(keys.leases, "a")
    now_ms = seconds * 1000 + micros // 1000
    assert now_ms + 7000 <= expiry < now_ms + 7000 + 1000


async def test_cancel_dequeues_or_signals_the_owner(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys)
    await queue.enqueue(job("waiting", 1, 10))
    await queue.enqueue(job("running", 2, 5))
    await queue.claim("w1", 1, lease_ms=1000)  # takes "running" (earlier deadline)
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(keys.control("w1"))
    assert await queue.cancel("waiting") == "dequeued"
    assert await queue.cancel("running", "test") == "signalled"
    assert await queue.cancel("nobody") == "unknown"
    message = None
    for _ in range(50):  # the first read may consume the subscribe confirmation
        message = await pubsub.get_message(timeout=0.1)
        if message is not None:
            break
    assert message is not None
    assert protocol.decode(message["data"]) == Cancel(request_id="running", reason="test")
    assert await queue.claim("w1", 5, lease_ms=1000) == []
    await pubsub.aclose()


async def test_idle_worker_wakes_on_enqueue(
    redis_url: str, redis: aioredis.Redis, keys: Keys
) -> None:
    queue = JobQueue(redis, keys)
    blocking = connect(redis_url, blocking=True)
    try:
        assert await queue.wait_for_work(blocking, timeout_s=0.05) is False
        waiter = asyncio.create_task(queue.wait_for_work(blocking, timeout_s=30))
        await asyncio.sleep(0)  # let the BLPOP start; the wake token also covers a late start
        await queue.enqueue(job("x", 1, 10))
        assert await waiter is True
        assert [j.id for j in await queue.claim("w1", 1, lease_ms=1000)] == ["x"]
    finally:
        await blocking.aclose()


def batch_job(job_id: str, arrival_ms: int) -> Job:
    return dataclasses.replace(
        job(job_id, arrival_ms, arrival_ms + 86_400_000), priority_class="batch"
    )


async def test_batch_room_caps_batch_claims(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys, "edf")
    for i in range(3):
        await queue.enqueue(batch_job(f"b{i}", i))
    await queue.enqueue(job("live", arrival_ms=10, deadline_ms=2000))
    claimed = await queue.claim("w1", 10, lease_ms=1000, batch_room=1)
    assert [j.id for j in claimed] == ["live", "b0"]
    assert (await queue.stats()).waiting == 2
    assert await queue.claim("w1", 10, lease_ms=1000, batch_room=0) == []
    await queue.ack("b0", "w1")
    assert not await redis.sismember(keys.batch_jobs, "b0")


async def test_fifo_batch_at_the_head_blocks_the_line(redis: aioredis.Redis, keys: Keys) -> None:
    # Plain arrival order has head-of-line blocking: that is what EDF is compared against.
    queue = JobQueue(redis, keys, "fifo")
    await queue.enqueue(batch_job("b0", 1))
    await queue.enqueue(job("live", arrival_ms=2, deadline_ms=100))
    assert await queue.claim("w1", 10, lease_ms=1000, batch_room=0) == []
    assert [j.id for j in await queue.claim("w1", 10, lease_ms=1000, batch_room=1)] == [
        "b0",
        "live",
    ]


async def test_expired_leases_are_reclaimed_once(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys)
    await queue.enqueue(job("a", 1, 10))
    await queue.claim("dead-worker", 1, lease_ms=1)
    await asyncio.sleep(0.01)  # let the 1 ms lease run out
    [orphan] = await queue.reclaim_expired("w2", lease_ms=5000)
    assert isinstance(orphan, Job) and orphan.id == "a"
    assert await queue.reclaim_expired("w3", lease_ms=5000) == []  # w2 holds it now
    assert not await queue.requeue(orphan, "w3")
    assert await queue.requeue(orphan, "w2")
    assert [j.id for j in await queue.claim("w3", 5, lease_ms=1000)] == ["a"]


async def test_dead_letter_and_poison(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys)
    await redis.hset(keys.jobs, "bad", b"\x93not a job")
    await redis.zadd(keys.queue, {"bad": 1})
    await queue.enqueue(job("good", 2, 20))
    claimed = await queue.claim("w1", 5, lease_ms=1000)
    assert isinstance(claimed[0], Poison) and claimed[0].id == "bad"
    assert isinstance(claimed[1], Job) and claimed[1].id == "good"
    assert await queue.dead_letter("bad", claimed[0].body, "w1")
    assert await redis.lrange(keys.dead, 0, -1) == [b"\x93not a job"]
    assert not await redis.hexists(keys.jobs, "bad")
    assert (await queue.stats()).claimed == 1


async def test_a_preferred_job_waits_for_its_worker_then_anyone(
    redis: aioredis.Redis, keys: Keys
) -> None:
    queue = JobQueue(redis, keys, "edf")
    await queue.enqueue(job("turn", arrival_ms=1, deadline_ms=100), prefer="w1", prefer_ms=300)
    await queue.enqueue(job("other", arrival_ms=2, deadline_ms=200))
    # Another worker skips the preferred job but still takes what comes after it.
    assert [j.id for j in await queue.claim("w2", 10, lease_ms=1000)] == ["other"]
    await queue.enqueue(job("turn2", arrival_ms=3, deadline_ms=50), prefer="w1", prefer_ms=300)
    assert [j.id for j in await queue.claim("w1", 10, lease_ms=1000)] == ["turn2", "turn"]
    assert await redis.hlen(keys.prefer) == 0
    # A preference lapses: a worker that is gone or busy does not strand the job.
    await queue.enqueue(job("late", arrival_ms=4, deadline_ms=100), prefer="w9", prefer_ms=100)
    assert await queue.claim("w2", 10, lease_ms=1000) == []
    await asyncio.sleep(0.15)
    assert [j.id for j in await queue.claim("w2", 10, lease_ms=1000)] == ["late"]


async def test_a_preferred_worker_is_woken_directly(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    queue = JobQueue(redis, keys)
    blocking = connect(redis_url, blocking=True)
    try:
        await redis.delete(keys.wake)
        waiter = asyncio.create_task(queue.wait_for_work(blocking, 5.0, worker_id="w1"))
        await asyncio.sleep(0.05)
        await queue.enqueue(job("turn", 1, 100), prefer="w1")
        assert await asyncio.wait_for(waiter, 2.0)
        assert await redis.llen(keys.wake_for("w1")) == 0  # w1 took its own token
    finally:
        await blocking.aclose()
