"""Direct writes: in-order content chunks go from the relay straight to the connection;
everything else keeps the queue, in order, exactly once."""

from __future__ import annotations

import asyncio
import gc
import json
import weakref

import httpx
import pytest
import redis.asyncio as aioredis

from cluster.wire.keys import Keys
from cluster.wire.protocol import Chunk
from gateway.streaming.relay import Inbox, ReplyStream
from gateway.streaming.socket_writer import ConnectionWriter, check_uvicorn
from tests.fakes import make_chunk
from tests.gateway.conftest import Gateway

MODEL = "smollm2-135m-instruct"


class _LogInbox:
    """What a ReplyStream asks of its inbox: the log, for gap repair."""

    def __init__(self, logged: list[Chunk]) -> None:
        self.logged = logged

    async def read_reply_log(self, request_id: str, from_seq: int) -> list[Chunk]:
        return [c for c in self.logged if c.seq >= from_seq]


def stream_with_sink(
    logged: list[Chunk] | None = None, accept: int = 1_000
) -> tuple[ReplyStream, list[int]]:
    """A stream whose direct sink records seqs and accepts the first ``accept`` chunks."""
    stream = ReplyStream(_LogInbox(logged or []), "r", maxsize=16)  # type: ignore[arg-type]
    taken: list[int] = []

    def sink(c: Chunk) -> bool:
        if not c.text or len(taken) >= accept:  # as the SSE sink: text only
            return False
        taken.append(c.seq)
        return True

    stream.direct = sink
    return stream, taken


async def test_content_goes_direct_while_the_reader_waits_and_the_end_is_queued() -> None:
    stream, taken = stream_with_sink()
    stream._deliver(make_chunk(1))  # before anyone waits: queued
    chunks = stream.chunks(5.0)
    assert (await anext(chunks)).seq == 1
    reader = asyncio.ensure_future(anext(chunks))
    await asyncio.sleep(0)  # the reader now waits, its sink armed
    for seq in (2, 3, 4):
        stream._deliver(make_chunk(seq))
    stream._deliver(make_chunk(5, finish_reason="stop"))
    assert (await reader).seq == 5
    assert taken == [2, 3, 4]


async def test_a_refused_chunk_and_everything_after_it_keep_their_order() -> None:
    stream, taken = stream_with_sink(accept=1)
    chunks = stream.chunks(5.0)
    reader = asyncio.ensure_future(anext(chunks))
    await asyncio.sleep(0)
    for seq in (1, 2, 3):
        stream._deliver(make_chunk(seq))
    stream._deliver(make_chunk(4, finish_reason="stop"))
    got = [(await reader).seq] + [c.seq async for c in chunks]
    # 1 went direct; the sink refused 2 (its socket was backed up, say): 2 and all
    # later chunks take the queue until the reader has caught up and waits again.
    assert taken == [1] and got == [2, 3, 4]


async def test_empty_and_out_of_order_chunks_take_the_queue_and_gaps_are_repaired() -> None:
    logged = [make_chunk(seq) for seq in range(1, 6)]
    stream, taken = stream_with_sink(logged)
    chunks = stream.chunks(5.0)
    reader = asyncio.ensure_future(anext(chunks))
    await asyncio.sleep(0)
    stream._deliver(make_chunk(1))
    stream._deliver(make_chunk(2, text=""))  # no text: no event of its own, the reader decides
    assert (await reader).seq == 2
    reader = asyncio.ensure_future(anext(chunks))
    await asyncio.sleep(0)
    stream._deliver(make_chunk(4))  # 3 was lost on pub/sub
    stream._deliver(make_chunk(5, finish_reason="stop"))
    got = [(await reader).seq] + [c.seq async for c in chunks]
    assert taken == [1] and got == [3, 4, 5]


async def test_direct_progress_keeps_an_idle_timeout_from_firing() -> None:
    stream, taken = stream_with_sink()
    chunks = stream.chunks(0.5)
    reader = asyncio.ensure_future(anext(chunks))
    for seq in range(1, 13):  # a chunk every 0.1 s, for 1.2 s: longer than the timeout
        await asyncio.sleep(0.1)
        stream._deliver(make_chunk(seq))
    assert not reader.done()
    with pytest.raises(TimeoutError):  # and then nothing comes
        await reader
    assert taken == list(range(1, 13))


async def test_no_writer_outside_uvicorns_httptools_protocol() -> None:
    async def send(message: object) -> None:
        pass

    assert ConnectionWriter.attach(None) is None
    assert ConnectionWriter.attach(send) is None


async def test_a_stream_through_uvicorn_writes_its_tokens_directly(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[bytes] = []
    original = ConnectionWriter.write

    def spy(self: ConnectionWriter, data: bytes) -> bool:
        written = original(self, data)
        if written:
            writes.append(data)
        return written

    monkeypatch.setattr(ConnectionWriter, "write", spy)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 40,
        "stream": True,
    }
    gateway.engine.delay_s = 0.02  # the reader is waiting when each token arrives
    try:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as http:
            resp = await http.post("/v1/chat/completions", json=body)
    finally:
        gateway.engine.delay_s = 0.002
    datas = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    events = [json.loads(d) for d in datas[:-1]]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert text == "".join(f" t{i}" for i in range(40))
    # Most tokens took the direct path, and what it wrote is what the client got.
    assert len(writes) >= 20
    assert all(w.decode() in resp.text for w in writes)


async def test_a_released_stream_lets_go_of_the_call_its_sink_writes_for(
    redis: aioredis.Redis,
) -> None:
    """A call holds its stream and the stream's sink holds the call (as ``ChatCall`` and
    its direct sink do): releasing the stream breaks the cycle, so reference counting
    frees the call when its request ends, not a collection that pauses every stream."""

    class Call:
        def __init__(self, stream: ReplyStream) -> None:
            self.stream = stream
            stream.direct = self.sink

        def sink(self, chunk: Chunk) -> bool:
            return True

    inbox = Inbox(redis, Keys("t"), "g")  # not started: open and release only
    call = Call(inbox.open("r1", "tenant"))
    gone = weakref.ref(call)
    gc.disable()
    try:
        inbox.release("r1")
        del call
        freed = gone() is None
    finally:
        gc.enable()
    assert freed and inbox.open_for("tenant") == 0


async def test_finished_requests_leave_nothing_for_the_garbage_collector(
    gateway: Gateway,
) -> None:
    """A request's objects are freed by reference counting when it ends: uvicorn's cycle
    holds the scope, so a scope that held the cycle's ``send`` after the request would
    leave both to a collection that pauses every stream of the gateway."""
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    gateway.engine.delay_s = 0.02  # tokens take the direct writer, which holds the cycle too
    gc.collect()
    gc.disable()  # from here on only reference counting frees anything, until the count
    try:
        # A connection of its own, closed before the count: uvicorn keeps an open
        # connection's last request cycle.
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as http:
            for stream in (True, False, True):
                resp = await http.post("/v1/chat/completions", json={**body, "stream": stream})
                assert resp.status_code == 200
        await asyncio.sleep(0.1)  # the server sees the connection close
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the collection finds is kept, to be looked at
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage if isinstance(o, RequestResponseCycle)]
        left += ["scope" for o in gc.garbage if isinstance(o, dict) and o.get("type") == "http"]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        gateway.engine.delay_s = 0.002
    assert left == []


async def test_a_failing_sink_is_dropped_and_the_stream_continues_queued() -> None:
    stream = ReplyStream(_LogInbox([]), "r", maxsize=16)  # type: ignore[arg-type]

    def broken(c: Chunk) -> bool:
        raise OSError("the transport is gone")

    stream.direct = broken
    chunks = stream.chunks(5.0)
    reader = asyncio.ensure_future(anext(chunks))
    await asyncio.sleep(0)
    stream._deliver(make_chunk(1))  # must not raise into the dispatcher
    stream._deliver(make_chunk(2, finish_reason="stop"))
    got = [(await reader).seq] + [c.seq async for c in chunks]
    assert got == [1, 2] and stream.direct is None


def test_the_installed_uvicorn_has_what_direct_writes_use() -> None:
    assert check_uvicorn() is None


def test_a_changed_request_cycle_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from uvicorn.protocols.http import httptools_impl

    class Renamed:
        def __init__(self) -> None:  # a uvicorn whose cycle no longer has a flow control
            self.transport = None

    monkeypatch.setattr(httptools_impl, "RequestResponseCycle", Renamed)
    reason = check_uvicorn()
    assert reason is not None and "flow" in reason and "response_started" in reason
