"""Resumable streams and slow readers."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import redis.asyncio as aioredis

from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import Chunk
from gateway.streaming.relay import Inbox, SlowConsumer
from gateway.streaming.resume import RequestMeta
from tests.gateway.conftest import Gateway

MODEL = "smollm2-135m-instruct"


def expected(n: int) -> str:
    return "".join(f" t{i}" for i in range(n))


def parse(raw_lines: list[str]) -> tuple[list[int], str, bool]:
    """(event ids, text, saw [DONE]) from SSE lines."""
    ids, parts, done = [], [], False
    for line in raw_lines:
        if line.startswith("id: "):
            ids.append(int(line[4:]))
        elif line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event["choices"]:
                parts.append(event["choices"][0]["delta"].get("content") or "")
    return ids, "".join(parts), done


async def test_resume_with_last_event_id_gives_the_uninterrupted_text(gateway: Gateway) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 60,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as http:
        seen: list[str] = []
        async with http.stream(
            "POST", "/v1/chat/completions", json=body, headers={"X-Resumable": "true"}
        ) as resp:
            completion_id = f"chatcmpl-{resp.headers['x-request-id']}"
            async for line in resp.aiter_lines():
                seen.append(line)
                if (
                    line.startswith("data: ")
                    and len([x for x in seen if x.startswith("id: ")]) >= 3
                ):
                    break  # connection lost after three events
        ids, first_part, _ = parse(seen)
        resumed = await http.get(
            f"/v1/chat/completions/{completion_id}/events", headers={"Last-Event-ID": str(ids[-1])}
        )
        assert resumed.status_code == 200
        more_ids, rest, done = parse(resumed.text.splitlines())
    assert done and more_ids[0] > ids[-1]
    assert first_part + rest == expected(60)  # nothing lost, nothing twice
    # The resumable request was not cancelled by the disconnect.
    assert resumed.headers["content-type"].startswith("text/event-stream")


async def test_replay_from_the_start_and_bad_ids(gateway: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as http:
        done = await http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7},
        )
        completion_id = done.json()["id"]
        replay = await http.get(f"/v1/chat/completions/{completion_id}/events")
        _, text, finished = parse(replay.text.splitlines())
        assert finished and text == expected(7) == done.json()["choices"][0]["message"]["content"]
        bad = await http.get(
            f"/v1/chat/completions/{completion_id}/events", headers={"Last-Event-ID": "yesterday"}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"
        unknown = await http.get("/v1/chat/completions/chatcmpl-nope/events")
        assert unknown.status_code == 404


async def test_another_tenant_cannot_read_the_log(gateway: Gateway, redis: aioredis.Redis) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as http:
        done = await http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        request_id = done.headers["x-request-id"]
        keys = gateway.keys
        meta = RequestMeta.decode(await redis.get(keys.request_meta(request_id)))
        assert meta.tenant == "default"
        # The same request, as if another tenant had made it.
        other = RequestMeta("someone-else", meta.completion_id, meta.model, meta.created, False)
        await redis.set(keys.request_meta(request_id), other.encode())
        resp = await http.get(f"/v1/chat/completions/chatcmpl-{request_id}/events")
    assert resp.status_code == 404  # not 403: its existence is not revealed


async def test_slow_reader_is_cut_off_without_delaying_others(
    redis: aioredis.Redis, keys: Keys
) -> None:
    inbox = Inbox(redis, keys, "g1", queue_size=4)
    await inbox.start()
    try:
        slow, fast = inbox.open("slow"), inbox.open("fast")
        for seq in range(1, 11):
            for rid in ("slow", "fast"):
                chunk = Chunk(
                    request_id=rid,
                    seq=seq,
                    text=f" {seq}",
                    completion_tokens=seq,
                    prompt_tokens=1,
                    finish_reason="stop" if seq == 10 else None,
                )
                await redis.publish(inbox.channel, protocol.encode(chunk))
            if seq % 2 == 0:  # the fast reader keeps up; the slow one never reads
                got = [c.seq async for c in _take(fast.chunks(5.0), 2)]
                assert got == [seq - 1, seq]
        with pytest.raises(SlowConsumer, match="more than 4 chunks behind"):
            async for _ in slow.chunks(5.0):
                pass
    finally:
        await inbox.close()


async def _take(chunks, n: int):  # type: ignore[no-untyped-def]
    count = 0
    async for chunk in chunks:
        yield chunk
        count += 1
        if count == n:
            return
    await asyncio.sleep(0)


async def test_a_chunk_lost_on_pubsub_is_repaired_from_the_log(
    redis: aioredis.Redis, keys: Keys
) -> None:
    inbox = Inbox(redis, keys, "g2")
    await inbox.start()
    try:
        stream = inbox.open("gappy")
        chunks = [
            Chunk(
                request_id="gappy",
                seq=seq,
                text=f" {seq}",
                completion_tokens=seq,
                prompt_tokens=1,
                finish_reason="stop" if seq == 5 else None,
            )
            for seq in range(1, 6)
        ]
        for chunk in chunks:
            data = protocol.encode(chunk)
            await redis.xadd(keys.reply_log("gappy"), {b"c": data})  # the worker always logs
            if chunk.seq != 3:  # ...but chunk 3 never arrives on pub/sub
                await redis.publish(inbox.channel, data)
        got = [c async for c in stream.chunks(5.0)]
    finally:
        await inbox.close()
    assert [c.seq for c in got] == [1, 2, 3, 4, 5]
    assert "".join(c.text for c in got) == " 1 2 3 4 5"
