"""The Redis queue against a real redis-server: order, fair shares, caps, leases,
cancellation, wake-up."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from unittest.mock import patch

import redis.asyncio as aioredis

from cluster.runtime.redis_client import connect
from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import Cancel, Job
from cluster.wire.queue import JobQueue, Poison, Share
from cluster.wire.vocabulary import PriorityClass


def job(
    job_id: str, arrival_ms: int, deadline_ms: int, tenant: str = "default", prompt: int = 1
) -> Job:
    return Job(
        id=job_id,
        reply_to="inbox",
        model="m",
        prompt_token_ids=[1] * prompt,
        max_tokens=1,
        sampling={},
        arrival_ms=arrival_ms,
        deadline_ms=deadline_ms,
        tenant=tenant,
    )


async def ids(queue: JobQueue, worker: str, n: int, **kwargs: int) -> list[str]:
    claimed = await queue.claim(worker, n, lease_ms=10_000, **kwargs)
    return [j.id for j in claimed.jobs]


async def test_edf_claims_earliest_deadline_first(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys, "edf")
    await queue.enqueue(job("late", arrival_ms=1, deadline_ms=900))
    await queue.enqueue(job("urgent", arrival_ms=2, deadline_ms=100))
    await queue.enqueue(job("middle", arrival_ms=3, deadline_ms=500))
    assert await ids(queue, "w1", 10) == ["urgent", "middle", "late"]


async def test_fifo_claims_in_arrival_order(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys, "fifo")
    await queue.enqueue(job("first", arrival_ms=1, deadline_ms=900))
    await queue.enqueue(job("second", arrival_ms=2, deadline_ms=100))
    assert await ids(queue, "w1", 10) == ["first", "second"]


async def test_claim_takes_at_most_what_was_asked(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys)
    for i in range(5):
        await queue.enqueue(job(f"j{i}", i, 100 + i))
    assert len(await ids(queue, "w1", 2)) == 2
    assert await ids(queue, "w1", 0) == []
    stats = await queue.stats()
    assert (stats.waiting, stats.claimed) == (3, 2)


async def test_a_claim_reports_redis_time(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys)
    await queue.enqueue(job("a", 1, 10))
    seconds, micros = await redis.time()
    claimed = await queue.claim("w1", 1, lease_ms=1000)
    assert 0 <= claimed.now_ms - (seconds * 1000 + micros // 1000) < 1000


async def test_duplicate_id_is_not_queued_twice(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys)
    assert (await queue.enqueue(job("same", 1, 10))).status == "queued"
    assert (await queue.enqueue(job("same", 2, 5))).status == "duplicate"
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
    assert not await redis.hexists(keys.job_info, "a")


async def test_lease_expiry_is_recorded_in_redis_time(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys)
    await queue.enqueue(job("a", 1, 10))
    seconds, micros = await redis.time()
    await queue.claim("w1", 1, lease_ms=7000)
    expiry = await redis.zscore(keys.leases, "a")
    now_ms = seconds * 1000 + micros // 1000
    assert now_ms + 7000 <= expiry < now_ms + 7000 + 1000


async def test_cancel_dequeues_or_signals_the_owner_and_is_recorded(
    redis: aioredis.Redis, keys: Keys
) -> None:
    queue = JobQueue(redis, keys)
    await queue.enqueue(job("waiting", 1, 10))
    await queue.enqueue(job("running", 2, 5))
    await queue.claim("w1", 1, lease_ms=1000)  # takes "running" (earlier deadline)
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(keys.control("w1"))
    assert await queue.cancel("waiting") == "dequeued"
    assert await queue.cancel("running", "test") == "signalled"
    assert await queue.cancel("not-yet") == "recorded"
    message = None
    for _ in range(50):  # the first read may consume the subscribe confirmation
        message = await pubsub.get_message(timeout=0.1)
        if message is not None:
            break
    assert message is not None
    assert protocol.decode(message["data"]) == Cancel(request_id="running", reason="test")
    assert await ids(queue, "w1", 5) == []
    assert await queue.cancelled(["waiting", "running", "not-yet", "other"]) == {
        "waiting",
        "running",
        "not-yet",
    }
    # Nothing of the dequeued job is left behind, counters included.
    assert not await redis.hexists(keys.job_info, "waiting")
    assert await redis.hget(keys.tenant_waiting, "default") is None
    await pubsub.aclose()


async def test_a_cancel_is_honoured_when_the_job_is_requeued(
    redis: aioredis.Redis, keys: Keys
) -> None:
    queue = JobQueue(redis, keys)
    await queue.enqueue(job("a", 1, 10))
    await queue.claim("dead-worker", 1, lease_ms=1)
    # The cancel reaches a worker that is gone; the record outlives it.
    assert await queue.cancel("a") == "signalled"
    await asyncio.sleep(0.01)
    [orphan] = await queue.reclaim_expired("w2", lease_ms=5000)
    assert isinstance(orphan, Job)
    assert await queue.requeue(orphan, "w2") == "cancelled"
    assert await ids(queue, "w3", 5) == []
    assert not await redis.hexists(keys.jobs, "a")
    assert await redis.hget(keys.tenant_running, "default") is None


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
        assert await ids(queue, "w1", 1) == ["x"]
    finally:
        await blocking.aclose()


async def test_a_claim_that_empties_the_queue_clears_its_stale_wake_tokens(
    redis_url: str, redis: aioredis.Redis, keys: Keys
) -> None:
    """A group's enqueues leave one token each; once one claim has taken them all, the
    tokens would only send the worker round empty claims, so they go, and the claim says
    the queue is drained. Tokens stay while anything waits (here a job preferring another
    worker)."""
    queue = JobQueue(redis, keys)
    for i in range(5):
        await queue.enqueue(job(f"g{i}", i, 100 + i))
    await queue.enqueue(job("theirs", 9, 200), prefer="w2", prefer_ms=60_000)
    assert await redis.llen(keys.wake) == 5 and await redis.llen(keys.wake_for("w2")) == 1
    first = await queue.claim("w1", 10, 60_000)
    assert [j.id for j in first.jobs] == [f"g{i}" for i in range(5)]
    assert not first.drained and await redis.llen(keys.wake) == 5  # "theirs" still waits
    last = await queue.claim("w2", 10, 60_000)
    assert [j.id for j in last.jobs] == ["theirs"] and last.drained
    assert not await redis.exists(keys.wake, keys.wake_for("w2"))
    # A worker blocking now waits for the next enqueue, not a stale token.
    blocking = connect(redis_url, blocking=True)
    try:
        assert await queue.wait_for_work(blocking, timeout_s=0.05, worker_id="w1") is False
        await queue.enqueue(job("next", 20, 300))
        assert await queue.wait_for_work(blocking, timeout_s=1.0, worker_id="w1") is True
    finally:
        await blocking.aclose()


def batch_job(
    job_id: str, arrival_ms: int, budget_ms: int = 86_400_000, tenant: str = "default"
) -> Job:
    return dataclasses.replace(
        job(job_id, arrival_ms, arrival_ms + budget_ms, tenant), priority_class="batch"
    )


async def test_batch_room_caps_batch_claims(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys, "edf")
    for i in range(3):
        await queue.enqueue(batch_job(f"b{i}", i))
    await queue.enqueue(job("live", arrival_ms=10, deadline_ms=2000))
    assert await ids(queue, "w1", 10, batch_room=1) == ["live", "b0"]
    assert (await queue.stats()).waiting == 2
    assert await ids(queue, "w1", 10, batch_room=0) == []
    await queue.ack("b0", "w1")
    assert not await redis.sismember(keys.batch_jobs, "b0")


async def test_a_batch_job_never_sorts_ahead_of_latency_bound_work(
    redis: aioredis.Redis, keys: Keys
) -> None:
    # A client picks both the class and the budget: a batch job with a 1 ms budget still
    # waits behind an interactive job due in a minute.
    queue = JobQueue(redis, keys, "edf")
    await queue.enqueue(batch_job("sneaky", 1, budget_ms=1, tenant="a"))
    await queue.enqueue(job("chat", 2, 60_000, tenant="b"))
    assert await ids(queue, "w1", 1) == ["chat"]
    assert await queue.ahead_of(queue.score(job("x", 3, 60_001))) == 0


async def test_fifo_batch_at_the_head_blocks_the_line(redis: aioredis.Redis, keys: Keys) -> None:
    # Plain arrival order has head-of-line blocking: that is what EDF is compared against.
    queue = JobQueue(redis, keys, "fifo")
    await queue.enqueue(batch_job("b0", 1))
    await queue.enqueue(job("live", arrival_ms=2, deadline_ms=100))
    assert await ids(queue, "w1", 10, batch_room=0) == []
    assert await ids(queue, "w1", 10, batch_room=1) == ["b0", "live"]


async def test_expired_leases_are_reclaimed_once(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys)
    await queue.enqueue(job("a", 1, 10))
    await queue.claim("dead-worker", 1, lease_ms=1)
    await asyncio.sleep(0.01)  # let the 1 ms lease run out
    [orphan] = await queue.reclaim_expired("w2", lease_ms=5000)
    assert isinstance(orphan, Job) and orphan.id == "a"
    assert await queue.reclaim_expired("w3", lease_ms=5000) == []  # w2 holds it now
    assert await queue.requeue(orphan, "w3") == "lost"
    assert await queue.requeue(orphan, "w2") == "requeued"
    assert await ids(queue, "w3", 5) == ["a"]


async def test_dead_letter_and_poison(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys)
    await redis.hset(keys.jobs, "bad", b"\x93not a job")
    await redis.zadd(keys.queue, {"bad": 1})
    await queue.enqueue(job("good", 2, 20))
    claimed = (await queue.claim("w1", 5, lease_ms=1000)).jobs
    assert isinstance(claimed[0], Poison) and claimed[0].id == "bad"
    assert isinstance(claimed[1], Job) and claimed[1].id == "good"
    assert await queue.dead_letter("bad", claimed[0].body, "w1")
    assert await redis.lrange(keys.dead, 0, -1) == [b"\x93not a job"]
    assert not await redis.hexists(keys.jobs, "bad")
    assert (await queue.stats()).claimed == 1


async def test_the_dead_letter_list_is_capped_by_bytes(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys)
    body = b"x" * 1000
    for i in range(5):
        await queue.enqueue(job(f"d{i}", i, 10))
    await queue.claim("w1", 5, lease_ms=10_000)
    script = queue._dead_letter
    for i in range(5):
        k = keys
        await script(
            keys=[*queue._common, k.dead, k.dead_bytes],
            args=[k.tenant_queue_prefix, f"d{i}", "w1", body, 100, 2500],
        )
    assert await redis.llen(keys.dead) == 2  # the oldest went first
    assert int(await redis.get(keys.dead_bytes)) == 2000


async def test_a_preferred_job_waits_for_its_worker_then_anyone(
    redis: aioredis.Redis, keys: Keys
) -> None:
    queue = JobQueue(redis, keys, "edf")
    await queue.enqueue(job("turn", arrival_ms=1, deadline_ms=100), prefer="w1", prefer_ms=300)
    await queue.enqueue(job("other", arrival_ms=2, deadline_ms=200))
    # Another worker skips the preferred job but still takes what comes after it.
    assert await ids(queue, "w2", 10) == ["other"]
    await queue.enqueue(job("turn2", arrival_ms=3, deadline_ms=50), prefer="w1", prefer_ms=300)
    assert await ids(queue, "w1", 10) == ["turn2", "turn"]
    assert await redis.hlen(keys.prefer) == 0
    # A preference lapses: a worker that is gone or busy does not strand the job.
    await queue.enqueue(job("late", arrival_ms=4, deadline_ms=100), prefer="w9", prefer_ms=100)
    assert await ids(queue, "w2", 10) == []
    await asyncio.sleep(0.15)
    assert await ids(queue, "w2", 10) == ["late"]


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


# -- tenants ----------------------------------------------------------------------------


async def test_a_flooding_tenant_waits_for_its_own_jobs_not_others(
    redis: aioredis.Redis, keys: Keys
) -> None:
    queue = JobQueue(redis, keys)
    # Tenant a queues 20 jobs due first; tenant b queues 3 due later.
    for i in range(20):
        await queue.enqueue(job(f"a{i}", i, 1_000 + i, tenant="a", prompt=50))
    for i in range(3):
        await queue.enqueue(job(f"b{i}", 100 + i, 5_000 + i, tenant="b", prompt=50))
    first = await ids(queue, "w1", 6)
    # EDF alone would give a0..a5; the fair share alternates the two tenants.
    assert Counter(i[0] for i in first) == {"a": 3, "b": 3}
    assert [i for i in first if i.startswith("a")] == ["a0", "a1", "a2"]  # EDF within a


async def test_weights_divide_the_claims(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys)
    for i in range(30):
        await queue.enqueue(job(f"a{i}", i, 1_000 + i, tenant="a", prompt=10), share=Share(3.0))
        await queue.enqueue(job(f"b{i}", i, 1_000 + i, tenant="b", prompt=10), share=Share(1.0))
    first = Counter(i[0] for i in await ids(queue, "w1", 20))
    assert first == {"a": 15, "b": 5}


async def test_a_returning_tenant_banks_no_credit_for_idle_time(
    redis: aioredis.Redis, keys: Keys
) -> None:
    queue = JobQueue(redis, keys)
    for i in range(10):
        await queue.enqueue(job(f"a{i}", i, 1_000 + i, tenant="a", prompt=10))
    await ids(queue, "w1", 10)  # a was served a lot while b was idle
    for i in range(10):
        await queue.enqueue(job(f"a{10 + i}", 20 + i, 2_000 + i, tenant="a", prompt=10))
        await queue.enqueue(job(f"b{i}", 20 + i, 2_000 + i, tenant="b", prompt=10))
    # b joins at a's virtual time: they alternate, b does not take the next ten.
    assert Counter(i[0] for i in await ids(queue, "w1", 10)) == {"a": 5, "b": 5}


async def test_the_reply_tokens_count_at_ack(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys)
    await queue.enqueue(job("a0", 1, 1_000, tenant="a", prompt=10))
    await queue.claim("w1", 1, lease_ms=10_000)
    await queue.ack("a0", "w1", completion_tokens=500)
    vtime = keys.virtual_time(PriorityClass.INTERACTIVE)
    assert float(await redis.hget(vtime, "a")) == 510.0


async def test_one_ack_call_finishes_several_jobs_each_on_its_own_lease(
    redis: aioredis.Redis, keys: Keys
) -> None:
    queue = JobQueue(redis, keys)
    for i in range(3):
        await queue.enqueue(job(f"a{i}", i, 1_000 + i, tenant="a", prompt=10))
    await queue.enqueue(job("b0", 5, 1_000, tenant="b", prompt=10))
    await queue.claim("w1", 3, lease_ms=10_000)  # a0, b0, a1 by fair share
    await queue.claim("w2", 1, lease_ms=10_000)  # a2
    done = await queue.ack_many("w1", [("a0", 100), ("a2", 7), ("b0", 40), ("a0", 1)])
    # a2's lease is w2's and a0 is already gone by its second pair: both left alone.
    assert done == [True, False, True, False]
    assert not await redis.hexists(keys.jobs, "a0")
    assert not await redis.hexists(keys.jobs, "b0")
    assert await redis.hexists(keys.jobs, "a1")
    assert await redis.hexists(keys.jobs, "a2")
    vtime = keys.virtual_time(PriorityClass.INTERACTIVE)
    # Each tenant is charged its own job's reply tokens (prompts were charged at claim):
    # not a2's, whose ack was refused.
    assert float(await redis.hget(vtime, "a")) == 3 * 10 + 100
    assert float(await redis.hget(vtime, "b")) == 10 + 40
    assert (await queue.stats()).claimed == 2
    assert await queue.ack_many("w1", []) == []


async def test_a_tenant_at_its_running_cap_is_passed_over(
    redis: aioredis.Redis, keys: Keys
) -> None:
    queue = JobQueue(redis, keys)
    capped = Share(max_running=1)
    for i in range(3):
        await queue.enqueue(job(f"a{i}", i, 100 + i, tenant="a"), share=capped)
    await queue.enqueue(job("b0", 10, 1_000, tenant="b"))
    assert await ids(queue, "w1", 10) == ["a0", "b0"]
    await queue.ack("a0", "w1")
    assert await ids(queue, "w1", 10) == ["a1"]


async def test_a_tenant_cap_refuses_at_enqueue(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys)
    share = Share(max_waiting=2)
    assert (await queue.enqueue(job("a0", 1, 10, tenant="a"), share=share)).status == "queued"
    assert (await queue.enqueue(job("a1", 2, 10, tenant="a"), share=share)).status == "queued"
    refused = await queue.enqueue(job("a2", 3, 10, tenant="a"), share=share)
    assert refused.status == "tenant_queue_full"
    assert (await queue.enqueue(job("b0", 4, 10, tenant="b"), share=share)).status == "queued"
    assert not await redis.hexists(keys.jobs, "a2")
    small = Share(max_waiting_bytes=10)
    assert (await queue.enqueue(job("c0", 5, 10, tenant="c"), share=small)).status == (
        "tenant_bytes_full"
    )
    assert (await queue.enqueue(job("d0", 6, 10, tenant="d"), max_waiting=3)).status == (
        "queue_full"
    )


async def test_the_same_request_id_attaches_or_conflicts(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys)
    first = await queue.enqueue(job("j1", 1, 10, tenant="a"), idempotency=("my-id", "d1"))
    assert first.status == "queued"
    again = await queue.enqueue(job("j2", 2, 10, tenant="a"), idempotency=("my-id", "d1"))
    assert (again.status, again.job_id) == ("attached", "j1")
    other = await queue.enqueue(job("j3", 3, 10, tenant="a"), idempotency=("my-id", "d2"))
    assert (other.status, other.job_id) == ("conflict", "j1")
    # Another tenant's same id is its own.
    mine = await queue.enqueue(job("j4", 4, 10, tenant="b"), idempotency=("my-id", "d1"))
    assert mine.status == "queued"
    assert (await queue.stats()).waiting == 2


async def test_a_gateway_that_is_gone_has_its_plain_jobs_dropped(
    redis: aioredis.Redis, keys: Keys
) -> None:
    queue = JobQueue(redis, keys)
    await redis.set(keys.gateway_alive("alive"), b"1")
    await queue.enqueue(job("orphan", 1, 10), gateway="dead", resumable=False)
    await queue.enqueue(job("kept", 2, 20), gateway="dead", resumable=True)
    await queue.enqueue(job("live", 3, 30), gateway="alive", resumable=False)
    assert await ids(queue, "w1", 10) == ["kept", "live"]
    assert not await redis.hexists(keys.jobs, "orphan")


async def test_position_counts_the_fair_share(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys)
    for i in range(50):
        await queue.enqueue(job(f"a{i}", i, 1_000 + i, tenant="a"))
    mine = job("b0", 100, 5_000, tenant="b")
    position = await queue.position(mine)
    assert position.ahead == 50 and position.own_ahead == 0 and position.tenants == 2
    assert position.fair_ahead == 1  # one turn of a, then b0


async def test_enqueues_of_one_turn_go_together_each_with_its_own_answer(
    redis: aioredis.Redis, keys: Keys
) -> None:
    queue = JobQueue(redis, keys)
    with patch.object(redis, "pipeline", wraps=redis.pipeline) as pipelines:
        burst = [queue.enqueue(job(f"b{i}", i, 100 + i), max_waiting=3) for i in range(5)]
        burst.append(queue.enqueue(job("b0", 9, 109)))  # the same id again
        answers = await asyncio.gather(*burst)
        assert [a.status for a in answers] == ["queued"] * 3 + ["queue_full"] * 2 + ["duplicate"]
        assert pipelines.call_count == 1
        assert await ids(queue, "w1", 10) == ["b0", "b1", "b2"]
        await queue.enqueue(job("alone", 20, 120))  # a call alone takes no pipeline
        assert pipelines.call_count == 1


async def test_a_burst_enqueues_after_redis_lost_its_scripts(
    redis: aioredis.Redis, keys: Keys
) -> None:
    queue = JobQueue(redis, keys)
    await queue.enqueue(job("first", 1, 100))
    await redis.script_flush()
    answers = await asyncio.gather(*(queue.enqueue(job(f"s{i}", i, 200 + i)) for i in range(3)))
    assert [a.status for a in answers] == ["queued"] * 3
    assert len(await ids(queue, "w1", 10)) == 4


async def test_a_clump_larger_than_a_pipeline_goes_in_several(
    redis: aioredis.Redis, keys: Keys
) -> None:
    queue = JobQueue(redis, keys)
    with (
        patch("cluster.wire.queue.BATCH_CALLS", 4),
        patch.object(redis, "pipeline", wraps=redis.pipeline) as pipelines,
    ):
        answers = await asyncio.gather(
            *(queue.enqueue(job(f"c{i}", i, 100 + i)) for i in range(10))
        )
        assert [a.status for a in answers] == ["queued"] * 10
        assert pipelines.call_count == 3
    assert len(await ids(queue, "w1", 20)) == 10


async def test_a_flush_cut_short_leaves_no_caller_waiting(
    redis: aioredis.Redis, keys: Keys
) -> None:
    queue = JobQueue(redis, keys)
    hang = asyncio.Event()

    async def never(*args: object, **kwargs: object) -> None:
        await hang.wait()

    with patch.object(type(redis.pipeline()), "execute", never):
        calls = [asyncio.create_task(queue.enqueue(job(f"h{i}", i, 100 + i))) for i in range(3)]
        await asyncio.sleep(0.05)
        for flush in list(queue._enqueue._turn._sending):  # the process stopping
            flush.cancel()
        done, pending = await asyncio.wait(calls, timeout=5)
    assert not pending
    assert all(task.cancelled() for task in done)
