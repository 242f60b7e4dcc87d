"""The consumer loop against a real redis-server with the deterministic test engine."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from cluster.runtime.clock import RedisClock
from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import Chunk, Job, WorkerStats
from cluster.wire.queue import Claimed, JobQueue
from cluster.wire.vocabulary import PriorityClass
from tests.fakes import FakeEngine, FakePushEngine
from tests.polling import Signal, eventually
from workers.engines.base import EngineOutput
from workers.loop.config import ConsumerConfig
from workers.loop.consumer import Consumer
from workers.loop.metrics import render_worker_metrics


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def make_job(
    job_id: str, reply_to: str, max_tokens: int = 3, budget_ms: int = 60_000, prompt_len: int = 2
) -> Job:
    arrival = now_ms()
    return Job(
        id=job_id,
        reply_to=reply_to,
        model="m",
        prompt_token_ids=[1] * prompt_len,
        max_tokens=max_tokens,
        sampling={},
        arrival_ms=arrival,
        deadline_ms=arrival + budget_ms,
    )


class Inbox:
    """Collects chunks published to one channel, per request."""

    def __init__(self, redis: aioredis.Redis, channel: str) -> None:
        self.channel = channel
        self._pubsub = redis.pubsub(ignore_subscribe_messages=True)
        self.chunks: dict[str, list[Chunk]] = {}
        self._task: asyncio.Task[None] | None = None
        self._signal = Signal()
        self.wait_until = self._signal.wait_until

    async def __aenter__(self) -> Inbox:
        await self._pubsub.subscribe(self.channel)
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._pubsub.aclose()

    async def _run(self) -> None:
        while True:
            message = await self._pubsub.get_message(timeout=None)
            if message is None:
                continue
            for chunk in protocol.decode_chunks(message["data"]):
                self.chunks.setdefault(chunk.request_id, []).append(chunk)
            self._signal.touch()

    async def final(self, request_id: str) -> list[Chunk]:
        """Wait for the final chunk of a request; return all its chunks."""

        def done() -> bool:
            got = self.chunks.get(request_id)
            return bool(got) and got[-1].is_final  # type: ignore[index]

        await self.wait_until(done)
        return self.chunks[request_id]


@pytest.fixture(params=[FakeEngine, FakePushEngine], ids=["generator", "push"])
async def engine(request: pytest.FixtureRequest) -> FakeEngine:
    """Every consumer test runs with outputs iterated from ``generate`` and with outputs
    pushed by the engine (workers.engines.base.run_generation): the behaviour must not differ."""
    engine_cls: type[FakeEngine] = request.param
    return engine_cls(max_slots=2)


@pytest.fixture
def claim_ahead() -> int:
    """The consumer's ``claim_ahead`` (a test may parametrize it)."""
    return 0


@pytest.fixture
async def consumer(
    redis_url: str, keys: Keys, engine: FakeEngine, claim_ahead: int
) -> AsyncIterator[Consumer]:
    config = ConsumerConfig(lease_ms=5000, heartbeat_ms=100, claim_ahead=claim_ahead)
    c = Consumer(redis_url, keys, engine, config)
    await c.start()
    yield c
    engine.release.set()
    await c.close()


async def test_reply_arrives_in_order_and_is_logged(
    redis: aioredis.Redis, keys: Keys, consumer: Consumer
) -> None:
    queue = JobQueue(redis, keys)
    async with Inbox(redis, keys.inbox("g1")) as inbox:
        await queue.enqueue(make_job("r1", inbox.channel, max_tokens=4))
        chunks = await inbox.final("r1")
    assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))
    assert "".join(c.text for c in chunks) == " t0 t1 t2 t3"
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].completion_tokens == 4 and chunks[-1].prompt_tokens == 2
    assert chunks[0].worker_id == consumer.worker_id
    logged = [
        protocol.decode_as(f[b"c"], Chunk) for _, f in await redis.xrange(keys.reply_log("r1"))
    ]
    assert logged == chunks
    assert await redis.pttl(keys.reply_log("r1")) > 0

    async def acked() -> bool:  # the ack follows the final publish
        return not await redis.hexists(keys.jobs, "r1")

    await eventually(acked)
    assert await redis.zcard(keys.leases) == 0


@pytest.mark.parametrize("claim_ahead", [0, 1])
async def test_claims_only_while_slots_are_free(
    redis: aioredis.Redis, keys: Keys, engine: FakeEngine, consumer: Consumer, claim_ahead: int
) -> None:
    """A worker holds its slots' worth of jobs, plus ``claim_ahead`` waiting in the engine's
    own queue, and no more."""
    engine.release.clear()
    held = 2 + claim_ahead
    queue = JobQueue(redis, keys)
    async with Inbox(redis, keys.inbox("g1")) as inbox:
        for i in range(5):
            await queue.enqueue(make_job(f"r{i}", inbox.channel))
        await engine.wait_until(lambda: engine.running == held)
        stats = await queue.stats()
        assert (stats.waiting, stats.claimed) == (5 - held, held)
        engine.release.set()
        for i in range(5):
            await inbox.final(f"r{i}")
    assert engine.max_running_seen == held
    assert sorted(engine.started) == [f"r{i}" for i in range(5)]


async def test_a_claimed_job_reaches_the_engine_before_the_next_claim(
    redis_url: str, redis: aioredis.Redis, keys: Keys
) -> None:
    """The claim loop lets a claimed job's task hand it to the engine before it packs and
    sends its next claim: that round trip must not sit in front of the job's first step."""
    events: list[str] = []

    class RecordingEngine(FakeEngine):
        async def generate(self, job: Job, priority: int) -> AsyncIterator[EngineOutput]:
            events.append(f"start {job.id}")
            async for out in super().generate(job, priority):
                yield out

    engine = RecordingEngine(max_slots=2)
    consumer = Consumer(redis_url, keys, engine, ConsumerConfig(lease_ms=5000, heartbeat_ms=100))
    await consumer.start()
    try:
        assert consumer._queue is not None
        claim = consumer._queue.claim

        async def recording_claim(*args: object, **kwargs: object) -> Claimed:
            events.append("claim")
            claimed = await claim(*args, **kwargs)  # type: ignore[arg-type]
            events.extend(f"claimed {job.id}" for job in claimed.jobs if isinstance(job, Job))
            return claimed

        consumer._queue.claim = recording_claim  # type: ignore[method-assign]
        queue = JobQueue(redis, keys)
        async with Inbox(redis, keys.inbox("g1")) as inbox:
            await queue.enqueue(make_job("r1", inbox.channel))
            await inbox.final("r1")
    finally:
        await consumer.close()
    # No claim was sent between the one that took r1 and r1's start.
    claimed = events.index("claimed r1")
    assert events[claimed + 1] == "start r1", events


async def test_a_claim_that_drains_the_queue_blocks_without_claiming_again(
    redis_url: str, redis: aioredis.Redis, keys: Keys
) -> None:
    """A claim that leaves nothing waiting is followed by a block on the wake lists, not
    by a claim that could only come back empty; the next enqueue's token wakes it."""
    events: list[str] = []
    consumer = Consumer(
        redis_url, keys, FakeEngine(max_slots=2), ConsumerConfig(lease_ms=5000, heartbeat_ms=100)
    )
    await consumer.start()
    try:
        assert consumer._queue is not None
        claim, wait_for_work = consumer._queue.claim, consumer._queue.wait_for_work

        async def recording_claim(*args: object, **kwargs: object) -> Claimed:
            claimed = await claim(*args, **kwargs)  # type: ignore[arg-type]
            events.append(" ".join(["claim", *(j.id for j in claimed.jobs)]))
            return claimed

        async def recording_wait(*args: object, **kwargs: object) -> bool:
            events.append("wait")
            return await wait_for_work(*args, **kwargs)  # type: ignore[arg-type]

        consumer._queue.claim = recording_claim  # type: ignore[method-assign]
        consumer._queue.wait_for_work = recording_wait  # type: ignore[method-assign]
        queue = JobQueue(redis, keys)
        async with Inbox(redis, keys.inbox("g1")) as inbox:
            await queue.enqueue(make_job("r1", inbox.channel))
            await inbox.final("r1")
            await queue.enqueue(make_job("r2", inbox.channel))
            await inbox.final("r2")
    finally:
        await consumer.close()
    for job_id in ("r1", "r2"):
        took = events.index(f"claim {job_id}")
        assert events[took + 1] == "wait", events


async def test_expired_job_is_dropped_with_a_clear_error(
    redis: aioredis.Redis, keys: Keys, engine: FakeEngine, consumer: Consumer
) -> None:
    queue = JobQueue(redis, keys)
    async with Inbox(redis, keys.inbox("g1")) as inbox:
        await queue.enqueue(make_job("old", inbox.channel, budget_ms=-1000))
        [chunk] = await inbox.final("old")
    assert chunk.finish_reason == "error" and chunk.error_code == "expired"
    assert "latency budget" in (chunk.error_message or "")
    assert "old" not in engine.started


async def test_cancel_aborts_a_running_job(
    redis: aioredis.Redis, keys: Keys, engine: FakeEngine, consumer: Consumer
) -> None:
    engine.delay_s = 0.01  # 1000 tokens would take 10 s
    queue = JobQueue(redis, keys)
    async with Inbox(redis, keys.inbox("g1")) as inbox:
        await queue.enqueue(make_job("long", inbox.channel, max_tokens=1000))
        await inbox.wait_until(lambda: "long" in inbox.chunks)
        assert await queue.cancel("long") == "signalled"
        chunks = await inbox.final("long")
    assert chunks[-1].error_code == "cancelled"
    assert engine.aborted == ["long"]
    assert chunks[-1].completion_tokens < 1000


async def test_a_lost_lease_abandons_the_job_silently(
    redis: aioredis.Redis, keys: Keys, engine: FakeEngine, consumer: Consumer
) -> None:
    engine.delay_s = 0.01
    queue = JobQueue(redis, keys)
    async with Inbox(redis, keys.inbox("g1")) as inbox:
        await queue.enqueue(make_job("taken", inbox.channel, max_tokens=1000))
        await inbox.wait_until(lambda: "taken" in inbox.chunks)
        # Another worker now holds the lease (ours expired during a partition, say).
        await redis.hset(keys.owners, "taken", "someone-else")
        await engine.wait_until(lambda: "taken" in engine.aborted, timeout_s=5)
        await asyncio.sleep(0.3)  # anything still queued for it would have been sent
    # The new owner continues the reply from the log: no error, no final chunk from here.
    assert all(c.error_code is None and not c.is_final for c in inbox.chunks["taken"])
    assert await redis.hget(keys.owners, "taken") == b"someone-else"


async def test_an_ack_refused_after_the_final_publish_is_logged_and_counted(
    redis: aioredis.Redis, keys: Keys, consumer: Consumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another worker takes the lease between the final publish and the ack: the reply
    stands (the new owner's recovery finds its final chunk), and the refusal is visible."""
    assert consumer._queue is not None
    ack_many = consumer._queue.ack_many

    async def taken_first(worker_id: str, finished: list[tuple[str, int]]) -> list[bool]:
        for job_id, _ in finished:
            await redis.hset(keys.owners, job_id, "someone-else")
        return await ack_many(worker_id, finished)

    monkeypatch.setattr(consumer._queue, "ack_many", taken_first)
    queue = JobQueue(redis, keys)
    with capture_logs() as logs:
        async with Inbox(redis, keys.inbox("g1")) as inbox:
            await queue.enqueue(make_job("late", inbox.channel, max_tokens=2))
            chunks = await inbox.final("late")

            async def refused_logged() -> bool:
                return any(e["event"].startswith("ack refused") for e in logs)

            await eventually(refused_logged)
    assert chunks[-1].finish_reason == "length" and chunks[-1].error_code is None
    refused = [e for e in logs if e["event"].startswith("ack refused")]
    assert refused[0]["log_level"] == "warning" and refused[0]["request_id"] == "late"
    exposition = render_worker_metrics(consumer.metrics, include_vllm=False)
    assert "charserve_worker_leases_lost_total 1.0" in exposition
    # The job is still the other worker's to finish, not dropped here.
    assert await redis.hget(keys.owners, "late") == b"someone-else"


async def test_engine_failure_ends_the_job_not_the_worker(
    redis: aioredis.Redis, keys: Keys, engine: FakeEngine, consumer: Consumer
) -> None:
    queue = JobQueue(redis, keys)
    async with Inbox(redis, keys.inbox("g1")) as inbox:
        engine.fail_with = "boom"
        await queue.enqueue(make_job("bad", inbox.channel))
        [chunk] = await inbox.final("bad")
        assert chunk.error_code == "internal_error" and "boom" in (chunk.error_message or "")
        engine.fail_with = None
        await queue.enqueue(make_job("good", inbox.channel))
        assert (await inbox.final("good"))[-1].finish_reason == "length"
    assert consumer.alive


async def test_a_routine_job_logs_at_debug_anything_else_at_info(
    redis_url: str, redis: aioredis.Redis, keys: Keys
) -> None:
    """A chat done at its first try has its gateway's line; its worker's is debug. A
    failure, a retry and batch work keep an info line."""
    engine = FakeEngine(max_slots=2)
    config = ConsumerConfig(lease_ms=5000, heartbeat_ms=100, batch_reserve_slots=0)
    consumer = Consumer(redis_url, keys, engine, config)
    await consumer.start()
    queue = JobQueue(redis, keys)
    try:
        with capture_logs() as logs:
            async with Inbox(redis, keys.inbox("g1")) as inbox:
                await queue.enqueue(make_job("chat", inbox.channel))
                await inbox.final("chat")
                retry = dataclasses.replace(make_job("retry", inbox.channel), attempt=1)
                await queue.enqueue(retry)
                await inbox.final("retry")
                bulk = make_job("bulk", inbox.channel)
                await queue.enqueue(dataclasses.replace(bulk, priority_class=PriorityClass.BATCH))
                await inbox.final("bulk")
                engine.fail_with = "boom"
                await queue.enqueue(make_job("bad", inbox.channel))
                await inbox.final("bad")

                async def all_logged() -> bool:
                    return sum(e["event"] == "job finished" for e in logs) == 4

                await eventually(all_logged)
    finally:
        await consumer.close()
    # In order: the chat, the retry, the batch job, the failure.
    finished = [
        (e["outcome"], e["attempt"], e["priority"], e["log_level"])
        for e in logs
        if e["event"] == "job finished"
    ]
    assert finished == [
        ("completed", 0, "interactive", "debug"),
        ("completed", 1, "interactive", "info"),
        ("completed", 0, "batch", "info"),
        ("error", 0, "interactive", "info"),
    ]


async def test_heartbeat_announces_the_worker(
    redis: aioredis.Redis, keys: Keys, consumer: Consumer
) -> None:
    assert await redis.zscore(keys.workers, consumer.worker_id) is not None
    stats = protocol.decode_as(await redis.get(keys.worker_stats(consumer.worker_id)), WorkerStats)
    assert stats.max_slots == 2 and stats.worker_id == consumer.worker_id


async def test_close_drains_running_work(redis_url: str, redis: aioredis.Redis, keys: Keys) -> None:
    engine = FakeEngine(max_slots=2, delay_s=0.01)
    c = Consumer(redis_url, keys, engine, ConsumerConfig(heartbeat_ms=100))
    await c.start()
    queue = JobQueue(redis, keys)
    async with Inbox(redis, keys.inbox("g1")) as inbox:
        await queue.enqueue(make_job("r", inbox.channel, max_tokens=20))
        await inbox.wait_until(lambda: "r" in inbox.chunks)
        await c.close()
        chunks = await inbox.final("r")
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 20
    assert await redis.zscore(keys.workers, c.worker_id) is None


async def _reported(redis: aioredis.Redis, keys: Keys, worker_id: str) -> WorkerStats:
    return protocol.decode_as(await redis.get(keys.worker_stats(worker_id)), WorkerStats)


async def test_a_wave_of_prefills_is_reported_by_its_tokens(
    redis_url: str, redis: aioredis.Redis, keys: Keys
) -> None:
    """Eight jobs that start together wait for their first token together. A job arriving
    alone afterwards is not estimated at the wave's time (which refused every chat until
    the figure faded), and jobs awaiting their prefill are reported as their prompt
    tokens at the cost per token the wave taught, not as their count times one prefill."""
    engine = FakeEngine(max_slots=8)
    engine.release.clear()
    c = Consumer(redis_url, keys, engine, ConsumerConfig(heartbeat_ms=50))
    await c.start()
    queue = JobQueue(redis, keys)
    try:
        async with Inbox(redis, keys.inbox("g1")) as inbox:
            for i in range(8):
                await queue.enqueue(make_job(f"w{i}", inbox.channel, 1, prompt_len=100))
            await engine.wait_until(lambda: engine.running == 8)
            await asyncio.sleep(0.4)  # the wave's prefill: at least 400 ms each
            engine.release.set()
            for i in range(8):
                await inbox.final(f"w{i}")

            async def settled() -> bool:
                stats = await _reported(redis, keys, c.worker_id)
                return stats.prefill_ms > 0 and stats.prefill_queued_ms == 0.0

            await eventually(settled)
            stats = await _reported(redis, keys, c.worker_id)
            assert stats.prefill_ms < 400 / 3
            # The wave's 800 tokens took at least 400 ms: at least 0.5 ms a token.
            per_token = stats.prefill_ms_per_token
            assert 0.5 <= per_token < 2.0

            # Two jobs of 100 tokens awaiting their first token: a third waits for theirs.
            engine.release.clear()
            enqueued_ms = RedisClock.from_time_reply(await redis.time())
            for i in range(2):
                await queue.enqueue(make_job(f"x{i}", inbox.channel, 1, prompt_len=100))
            await engine.wait_until(lambda: engine.running == 2)

            async def queued() -> bool:
                stats = await _reported(redis, keys, c.worker_id)
                return stats.prefill_queued_ms == pytest.approx(200 * per_token)

            await eventually(queued)
            # Figures that show the claims are stamped after them, on Redis's clock (a
            # gateway counts its admissions since then as not in them).
            assert (await _reported(redis, keys, c.worker_id)).at_ms >= enqueued_ms
            assert (await _reported(redis, keys, c.worker_id)).prefill_ms < 400 / 3
            engine.release.set()
            for i in range(2):
                await inbox.final(f"x{i}")
    finally:
        engine.release.set()
        await c.close()


async def test_the_prefills_awaited_are_reported_between_beats(
    redis_url: str, redis: aioredis.Redis, keys: Keys
) -> None:
    """The prompt tokens awaiting their prefill are reported within a fraction of a second
    of a change, not a beat (5 s here): a beat-old count went on refusing every chat after
    the prefills it counted had drained."""
    engine = FakeEngine(max_slots=4)
    config = ConsumerConfig(heartbeat_ms=5000, lease_ms=30000)
    c = Consumer(redis_url, keys, engine, config)
    await c.start()
    queue = JobQueue(redis, keys)

    async def reported() -> WorkerStats:
        return await _reported(redis, keys, c.worker_id)

    async def reported_is(holds: Callable[[float], bool]) -> bool:
        return holds((await reported()).prefill_queued_ms)

    try:
        async with Inbox(redis, keys.inbox("g1")) as inbox:
            engine.release.clear()
            await queue.enqueue(make_job("a", inbox.channel, 1, prompt_len=300))
            await engine.wait_until(lambda: engine.running == 1)
            await asyncio.sleep(0.2)  # a prefill of at least 200 ms
            engine.release.set()
            await inbox.final("a")

            async def learnt() -> bool:
                return (await reported()).prefill_ms_per_token > 0

            await eventually(learnt, timeout_s=1.0)
            per_token = (await reported()).prefill_ms_per_token

            engine.release.clear()
            for i in range(2):
                await queue.enqueue(make_job(f"b{i}", inbox.channel, 1, prompt_len=300))
            await engine.wait_until(lambda: engine.running == 2)
            awaited = 600 * per_token
            await eventually(lambda: reported_is(lambda r: r == pytest.approx(awaited)), 1.0)
            engine.release.set()
            for i in range(2):
                await inbox.final(f"b{i}")
            # The two are out of prefill: nothing awaits.
            await eventually(lambda: reported_is(lambda r: r == 0.0), timeout_s=1.0)
    finally:
        engine.release.set()
        await c.close()
