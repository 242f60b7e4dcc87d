"""The publisher's framing: one Lua call logs every chunk and publishes one batch per
gateway inbox, against a real redis-server."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import Chunk, Job
from cluster.wire.replylog import read_reply_log
from workers.engines.base import EngineOutput
from workers.loop import publisher as publisher_module
from workers.loop.publisher import Publisher, RequestStream


def _stream(request_id: str, reply_to: str) -> RequestStream:
    job = Job(
        id=request_id,
        reply_to=reply_to,
        model="m",
        prompt_token_ids=[1],
        max_tokens=2,
        sampling={},
        arrival_ms=0,
        deadline_ms=10**13,
    )
    return RequestStream(job=job, worker_id="w", queue_ms=0.0)


async def _published(pubsub: aioredis.client.PubSub) -> list[list[Chunk]]:
    """Every message on the subscribed channels until none came for 0.3 s, each as its
    list of chunks (subscribe confirmations are skipped, and read as None)."""
    messages = []
    loop = asyncio.get_running_loop()
    quiet_until = loop.time() + 0.3
    while loop.time() < quiet_until:
        message = await pubsub.get_message(timeout=0.05)
        if message is not None:
            messages.append(protocol.decode_chunks(message["data"]))
            quiet_until = loop.time() + 0.3
    return messages


async def test_one_step_is_one_message_per_inbox_and_every_chunk_is_logged(
    redis: aioredis.Redis, keys: Keys
) -> None:
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe("inbox-a", "inbox-b")
    publisher = Publisher(redis, keys)
    streams = [_stream(f"r{i}", "inbox-a" if i % 2 else "inbox-b") for i in range(10)]
    try:
        # Marked before the flush task runs: all ten go in one flush.
        for stream in streams:
            stream.add(EngineOutput(f" {stream.job.id}", [7], None, prompt_tokens=1))
            publisher.mark(stream)
        await publisher.start()
        await publisher.flush()
        by_channel = {}
        for message in await _published(pubsub):
            assert len({c.request_id for c in message}) == len(message)
            for chunk in message:
                by_channel.setdefault(chunk.request_id, []).append(len(message))
        assert sorted(by_channel) == sorted(s.job.id for s in streams)
        # Two inboxes, five streams each: one message of five chunks per inbox.
        assert all(sizes == [5] for sizes in by_channel.values())
        for stream in streams:
            (logged,) = await read_reply_log(redis, keys, stream.job.id)
            assert (logged.seq, logged.text) == (1, f" {stream.job.id}")
            # The first chunk sets the log's TTL.
            assert 0 < await redis.pttl(keys.reply_log(stream.job.id)) <= 3_600_000
    finally:
        await publisher.close()
        await pubsub.aclose()


async def test_a_large_step_is_split_across_calls_without_losing_order(
    redis: aioredis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publisher_module, "MAX_CHUNKS_PER_CALL", 3)
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe("inbox")
    publisher = Publisher(redis, keys)
    streams = [_stream(f"r{i}", "inbox") for i in range(7)]
    try:
        for step in range(2):
            for stream in streams:
                out = EngineOutput(
                    text=f" {step}",
                    token_ids=[step],
                    prompt_tokens=1,
                    finish_reason="length" if step == 1 else None,
                )
                stream.add(out)
                publisher.mark(stream)
            if step == 0:
                await publisher.start()
            await publisher.flush()
        await asyncio.gather(*(s.done.wait() for s in streams))
        messages = await _published(pubsub)
        assert max(len(m) for m in messages) <= 3
        for stream in streams:
            got = [c for m in messages for c in m if c.request_id == stream.job.id]
            assert [c.seq for c in got] == [1, 2] and got[-1].is_final
            logged = await read_reply_log(redis, keys, stream.job.id)
            assert [c.text for c in logged] == [" 0", " 1"]
    finally:
        await publisher.close()
        await pubsub.aclose()


async def test_the_first_and_the_final_chunk_set_the_log_ttl(
    redis: aioredis.Redis, keys: Keys
) -> None:
    publisher = Publisher(redis, keys, reply_log_ttl_s=60)
    streams = [_stream(f"r{i}", "inbox") for i in range(3)]
    key = keys.reply_log("r1")
    await publisher.start()
    try:
        for step, finish in enumerate([None, None, "length"]):
            for stream in streams:
                stream.add(EngineOutput(f" {step}", [step], finish, prompt_tokens=1))
                publisher.mark(stream)
            await publisher.flush()
            if step == 0:
                assert 0 < await redis.pttl(key) <= 60_000
                await redis.persist(key)  # so a later PEXPIRE shows
            elif step == 1:
                assert await redis.pttl(key) == -1  # a middle chunk leaves the TTL alone
        assert 0 < await redis.pttl(key) <= 60_000
        for stream in streams:
            logged = await read_reply_log(redis, keys, stream.job.id)
            assert [c.seq for c in logged] == [1, 2, 3] and logged[-1].is_final
    finally:
        await publisher.close()


async def test_chunks_of_every_size_are_logged_from_the_inbox_message(
    redis: aioredis.Redis, keys: Keys
) -> None:
    # The Lua call cuts each chunk out of its inbox's ChunkBatch: more than 15 chunks (a
    # 16-bit array header) and chunks of 8-, 16- and 32-bit lengths must all come out whole.
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe("inbox")
    publisher = Publisher(redis, keys)
    streams = [_stream(f"r{i}", "inbox") for i in range(20)]
    texts = {s.job.id: " x" for s in streams} | {"r1": "é" * 200, "r2": "y" * 70_000}
    try:
        for stream in streams:
            stream.add(EngineOutput(texts[stream.job.id], [1], None, prompt_tokens=1))
            publisher.mark(stream)
        await publisher.start()
        await publisher.flush()
        [message] = await _published(pubsub)
        assert [c.text for c in message] == [texts[s.job.id] for s in streams]
        for stream in streams:
            (logged,) = await read_reply_log(redis, keys, stream.job.id)
            assert logged.text == texts[stream.job.id]
    finally:
        await publisher.close()
        await pubsub.aclose()


async def test_a_worker_that_lost_the_lease_cannot_publish(
    redis: aioredis.Redis, keys: Keys
) -> None:
    """The lease fences publishing: chunks of a job another worker owns now are neither
    logged nor sent, and the job comes back to the publisher's owner to drop."""
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe("inbox-a")
    await redis.hset(keys.owners, mapping={"mine": "w", "taken": "other-worker"})
    publisher = Publisher(redis, keys, worker_id="w")
    fenced: list[str] = []
    publisher.on_fenced = fenced.extend
    streams = [_stream(rid, "inbox-a") for rid in ("mine", "taken", "free")]
    try:
        for stream in streams:
            stream.add(EngineOutput(f" {stream.job.id}", [7], None, prompt_tokens=1))
            publisher.mark(stream)
        await publisher.start()
        await publisher.flush()
        [message] = await _published(pubsub)
    finally:
        await publisher.close()
        await pubsub.aclose()
    assert sorted(c.request_id for c in message) == ["free", "mine"]
    assert fenced == ["taken"]
    assert await read_reply_log(redis, keys, "taken") == []
    assert [c.text for c in await read_reply_log(redis, keys, "mine")] == [" mine"]


async def test_a_message_to_a_gateway_that_is_gone_is_reported(
    redis: aioredis.Redis, keys: Keys
) -> None:
    publisher = Publisher(redis, keys, worker_id="w")
    gone: list[str] = []
    publisher.on_gateway_gone = gone.extend
    await redis.set(keys.gateway_alive("alive"), b"1")
    # Nobody subscribes to either inbox; only one gateway's liveness key is gone.
    streams = [_stream("a", keys.inbox("alive")), _stream("b", keys.inbox("dead"))]
    try:
        for stream in streams:
            stream.add(EngineOutput(" x", [7], None, prompt_tokens=1))
            publisher.mark(stream)
        await publisher.start()
        await publisher.flush()
    finally:
        await publisher.close()
    assert gone == [keys.inbox("dead")]
    # Both replies are still in their logs: a resumable one can be read from there.
    assert len(await read_reply_log(redis, keys, "b")) == 1
