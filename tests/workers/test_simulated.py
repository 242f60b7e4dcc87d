"""The simulated engine: both ways of receiving its outputs (iterating ``generate`` and
the push path ``generate_into``) give the same reply, and the push path cancels, fails
and serves the consumer like the generator does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from cluster.wire.keys import Keys
from cluster.wire.protocol import Job
from cluster.wire.queue import JobQueue
from tests.workers.test_consumer import Inbox, make_job
from workers.engines.base import EngineOutput, run_generation
from workers.engines.simulated import (
    SimulatedConfig,
    SimulatedEngine,
    simulated_text,
    simulated_token,
)
from workers.loop.config import ConsumerConfig
from workers.loop.consumer import Consumer

FAST = SimulatedConfig(max_num_seqs=8, step_base_ms=1, step_ms_per_seq=0, prefill_ms_per_token=0)


def _job(job_id: str, max_tokens: int = 5, resume_token_ids: list[int] | None = None) -> Job:
    return Job(
        id=job_id,
        reply_to="inbox",
        model="m",
        prompt_token_ids=[3, 1, 4],
        max_tokens=max_tokens,
        sampling={},
        arrival_ms=0,
        deadline_ms=10**13,
        resume_token_ids=resume_token_ids or [],
    )


def _expected(job: Job) -> list[EngineOutput]:
    positions = range(len(job.resume_token_ids), job.max_tokens)
    return [
        EngineOutput(
            text=simulated_text(simulated_token(job.prompt_token_ids, i)),
            token_ids=[simulated_token(job.prompt_token_ids, i)],
            finish_reason="length" if i == job.max_tokens - 1 else None,
            prompt_tokens=len(job.prompt_token_ids),
        )
        for i in positions
    ]


@pytest.fixture
async def engine() -> AsyncIterator[SimulatedEngine]:
    engine = SimulatedEngine(FAST)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("resume", [[], [7, 8]], ids=["fresh", "resumed"])
async def test_push_and_generator_paths_give_the_same_reply(
    engine: SimulatedEngine, resume: list[int]
) -> None:
    job = _job("r", resume_token_ids=resume)
    pulled = [out async for out in engine.generate(job, priority=0)]
    pushed: list[EngineOutput] = []
    await engine.generate_into(job, 0, pushed.append)
    assert pulled == pushed == _expected(job)


async def test_run_generation_uses_the_push_path_when_the_engine_has_one(
    engine: SimulatedEngine,
) -> None:
    class PullOnly:
        """The same engine without its push path (as vLLM's is)."""

        max_slots = engine.max_slots
        generate = engine.generate

    job = _job("r")
    got: dict[str, list[EngineOutput]] = {"push": [], "pull": []}
    await run_generation(engine, job, 0, got["push"].append)
    await run_generation(PullOnly(), job, 0, got["pull"].append)  # type: ignore[arg-type]
    assert got["push"] == got["pull"] == _expected(job)


async def test_cancelling_the_push_path_stops_the_request(engine: SimulatedEngine) -> None:
    got: list[EngineOutput] = []
    three = asyncio.Event()

    def sink(out: EngineOutput) -> None:
        got.append(out)
        if len(got) == 3:
            three.set()

    task = asyncio.create_task(engine.generate_into(_job("long", max_tokens=10_000), 0, sink))
    await three.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    seen = len(got)
    await asyncio.sleep(0.02)  # many steps
    assert len(got) == seen
    # The slot is free again: a new request runs to its end.
    done: list[EngineOutput] = []
    await asyncio.wait_for(engine.generate_into(_job("next"), 0, done.append), 5)
    assert done == _expected(_job("next"))


async def test_a_failing_sink_ends_its_request_only(engine: SimulatedEngine) -> None:
    def explode(out: EngineOutput) -> None:
        raise ValueError("sink broke")

    fine: list[EngineOutput] = []
    results = await asyncio.gather(
        engine.generate_into(_job("bad"), 0, explode),
        engine.generate_into(_job("good"), 0, fine.append),
        return_exceptions=True,
    )
    assert isinstance(results[0], ValueError) and results[1] is None
    assert fine == _expected(_job("good"))
    await engine.check_health()


async def test_the_consumer_streams_a_simulated_reply(
    redis_url: str, redis: aioredis.Redis, keys: Keys
) -> None:
    engine = SimulatedEngine(SimulatedConfig(max_num_seqs=4, step_base_ms=20, step_ms_per_seq=0))
    consumer = Consumer(redis_url, keys, engine, ConsumerConfig(heartbeat_ms=100))
    await consumer.start()
    queue = JobQueue(redis, keys)
    try:
        async with Inbox(redis, keys.inbox("g1")) as inbox:
            job = make_job("r1", inbox.channel, max_tokens=6)
            started = time.perf_counter()
            await queue.enqueue(job)
            chunks = await inbox.final("r1")
        assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))
        assert "".join(c.text for c in chunks) == "".join(o.text for o in _expected(job))
        assert chunks[-1].completion_tokens == 6 and chunks[-1].finish_reason == "length"
        # The first token came one modelled step after the claim.
        assert 15 <= chunks[0].prefill_ms <= (time.perf_counter() - started) * 1000
    finally:
        await consumer.close()
        engine.shutdown()
