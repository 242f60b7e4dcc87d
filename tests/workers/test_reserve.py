"""The batch reserve: fixed, or following the latency-bound jobs in flight."""

from __future__ import annotations

import dataclasses

import pytest
import redis.asyncio as aioredis

from cluster.wire.keys import Keys
from cluster.wire.queue import JobQueue
from tests.fakes import FakeEngine
from tests.workers.test_consumer import Inbox, make_job
from workers.loop import reserve as reserve_module
from workers.loop.config import ConsumerConfig
from workers.loop.consumer import Consumer
from workers.loop.reserve import BatchReserve


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(reserve_module.time, "monotonic", c)
    return c


def test_fixed_reserve_ignores_demand(clock: Clock) -> None:
    r = BatchReserve(16)
    r.note(30)
    assert not r.adaptive and r.slots() == 16


def test_adaptive_reserve_follows_the_peak_of_the_window(clock: Clock) -> None:
    r = BatchReserve(16, least=2, window_s=30.0, headroom=2)
    assert r.slots() == 2  # nobody chatting: batch may take all but 2
    for n in (1, 2, 5, 3):
        r.note(n)
    assert r.slots() == 7  # the peak (5) plus headroom
    r.note(1)
    clock.now += 29.0
    assert r.slots() == 7  # a lull inside the window keeps the slots
    clock.now += 2.0
    assert r.slots() == 3  # the peak left the window; the current load (1) + 2
    r.note(0)
    clock.now += 31.0
    assert r.slots() == 2
    r.note(40)
    assert r.slots() == 16  # never above the configured most


async def test_adaptive_reserve_lets_batch_fill_until_chats_arrive(
    redis_url: str, redis: aioredis.Redis, keys: Keys
) -> None:
    engine = FakeEngine(max_slots=6)
    engine.release.clear()
    config = ConsumerConfig(
        heartbeat_ms=50, batch_reserve_slots=4, batch_reserve_min=1, batch_starts_per_s=0.0
    )
    consumer = Consumer(redis_url, keys, engine, config)
    queue = JobQueue(redis, keys)
    try:
        async with Inbox(redis, keys.inbox("g")) as inbox:
            for i in range(8):
                job = dataclasses.replace(make_job(f"b{i}", inbox.channel), priority_class="batch")
                await queue.enqueue(dataclasses.replace(job, deadline_ms=job.arrival_ms + 10**8))
            await consumer.start()
            # No chat seen yet: batch takes all but the least reserve (6 - 1).
            await engine.wait_until(lambda: engine.running == 5)
            await queue.enqueue(make_job("chat", inbox.channel))
            await engine.wait_until(lambda: "chat" in engine.started)
            engine.release.set()
            for job_id in ("chat", *(f"b{i}" for i in range(8))):
                await inbox.final(job_id)
    finally:
        engine.release.set()
        await consumer.close()
    # Once a chat was in flight the reserve rose to 1 + 2 = 3, above the fixed least.
    assert consumer._reserve.slots() == 3
