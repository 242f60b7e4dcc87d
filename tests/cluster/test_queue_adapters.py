"""Routing by LoRA adapter, against a real redis-server: a job whose model names an adapter
is claimed only by a worker that serves it, wakes only such workers, and keeps its route
through a requeue; the base model's jobs go to any worker."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from cluster.runtime.redis_client import connect
from cluster.wire.keys import Keys
from cluster.wire.protocol import Job
from cluster.wire.queue import JobQueue

BASE = "base-model"


def job(job_id: str, model: str = BASE, deadline_ms: int = 100, tenant: str = "t") -> Job:
    return Job(
        id=job_id,
        reply_to="inbox",
        model=model,
        prompt_token_ids=[1],
        max_tokens=1,
        sampling={},
        arrival_ms=1,
        deadline_ms=deadline_ms,
        tenant=tenant,
    )


async def ids(queue: JobQueue, worker: str, n: int, adapters: tuple[str, ...] = ()) -> list[str]:
    claimed = await queue.claim(worker, n, lease_ms=10_000, adapters=adapters)
    return [j.id for j in claimed.jobs if isinstance(j, Job)]


async def test_an_adapter_job_goes_only_to_a_worker_serving_it(
    redis: aioredis.Redis, keys: Keys
) -> None:
    queue = JobQueue(redis, keys, base_model=BASE)
    await queue.enqueue(job("pirate-1", "pirate", deadline_ms=10))
    await queue.enqueue(job("base-1", deadline_ms=20))
    await queue.enqueue(job("poet-1", "poet", deadline_ms=30))
    # A worker without adapters passes over the more urgent adapter jobs.
    assert await ids(queue, "plain", 10) == ["base-1"]
    assert await ids(queue, "poet-only", 10, ("poet",)) == ["poet-1"]
    assert await ids(queue, "pirate-too", 10, ("pirate", "poet")) == ["pirate-1"]
    assert (await queue.stats()).waiting == 0


async def test_a_worker_serving_adapters_takes_base_jobs_too(
    redis: aioredis.Redis, keys: Keys
) -> None:
    queue = JobQueue(redis, keys, base_model=BASE)
    await queue.enqueue(job("base-1", deadline_ms=10))
    await queue.enqueue(job("pirate-1", "pirate", deadline_ms=20))
    assert await ids(queue, "w", 10, ("pirate",)) == ["base-1", "pirate-1"]


async def test_skipped_adapter_jobs_do_not_block_a_tenants_base_jobs(
    redis: aioredis.Redis, keys: Keys
) -> None:
    queue = JobQueue(redis, keys, base_model=BASE)
    for i in range(5):
        await queue.enqueue(job(f"pirate-{i}", "pirate", deadline_ms=10 + i))
    await queue.enqueue(job("base-1", deadline_ms=50))
    assert await ids(queue, "plain", 10) == ["base-1"]
    assert len(await ids(queue, "lora", 10, ("pirate",))) == 5


async def test_without_a_base_model_no_job_names_an_adapter(
    redis: aioredis.Redis, keys: Keys
) -> None:
    # What every queue did before adapters: the model is not a route.
    queue = JobQueue(redis, keys)
    await queue.enqueue(job("any", "whatever-model"))
    assert queue.adapter(job("any", "whatever-model")) == ""
    assert await ids(queue, "plain", 10) == ["any"]


def test_an_adapter_name_cannot_break_the_job_info(redis: aioredis.Redis, keys: Keys) -> None:
    queue = JobQueue(redis, keys, base_model=BASE)
    assert queue.adapter(job("a", "pirate")) == "pirate"
    assert queue.adapter(job("b", BASE)) == ""
    with pytest.raises(ValueError, match="not an adapter name"):
        queue.adapter(job("c", "pi|rate"))


async def test_an_adapter_job_wakes_only_the_workers_serving_it(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    queue = JobQueue(redis, keys, base_model=BASE)
    blocking = connect(redis_url, blocking=True)
    try:
        await queue.enqueue(job("pirate-1", "pirate"))
        assert not await queue.wait_for_work(blocking, 0.05, "plain")
        assert await queue.wait_for_work(blocking, 0.05, "lora", adapters=("pirate",))
        await queue.enqueue(job("base-1"))
        assert await queue.wait_for_work(blocking, 0.05, "plain")
    finally:
        await blocking.aclose()


async def test_a_requeued_adapter_job_keeps_its_route(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    queue = JobQueue(redis, keys, base_model=BASE)
    await queue.enqueue(job("pirate-1", "pirate"))
    claimed = await queue.claim("lora-a", 1, lease_ms=10_000, adapters=("pirate",))
    (taken,) = claimed.jobs
    assert isinstance(taken, Job)
    assert await queue.requeue(taken, "lora-a") == "requeued"
    blocking = connect(redis_url, blocking=True)
    try:
        assert await queue.wait_for_work(blocking, 0.05, "lora-b", adapters=("pirate",))
    finally:
        await blocking.aclose()
    assert await ids(queue, "plain", 10) == []
    assert await ids(queue, "lora-b", 10, ("pirate",)) == ["pirate-1"]


async def test_a_worker_can_take_an_affine_adapter_job_it_serves(
    redis: aioredis.Redis, keys: Keys
) -> None:
    queue = JobQueue(redis, keys, base_model=BASE)
    await queue.enqueue(job("turn", "pirate"), prefer="lora-a", prefer_ms=60_000)
    assert await ids(queue, "lora-b", 10, ("pirate",)) == []  # it waits for its replica
    assert await ids(queue, "lora-a", 10, ("pirate",)) == ["turn"]
