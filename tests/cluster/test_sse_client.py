"""The lean client's HTTP/1.1 + SSE parser, fed bytes split every which way."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.bench import lean_client as sse_client
from cluster.bench.lean_client import ProtocolViolation, _StreamProtocol
from cluster.bench.samples import Sample

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class FakeTransport:
    """Records what the protocol writes and whether it closed the connection."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closed = True


def event(seq: int, content: str | None = None, **extra: Any) -> bytes:
    """One OpenAI chunk as an SSE event (``content=None``: an empty delta)."""
    delta = {} if content is None else {"content": content}
    body = {"id": "c", "object": "chat.completion.chunk", "choices": [{"delta": delta}], **extra}
    return f"id: {seq}\ndata: {json.dumps(body)}\n\n".encode()


def usage(tokens: int) -> bytes:
    body = {"choices": [], "usage": {"completion_tokens": tokens, "prompt_tokens": 7}}
    return f"data: {json.dumps(body)}\n\n".encode()


def chunk(data: bytes, extension: bytes = b"") -> bytes:
    return b"%x%s\r\n%s\r\n" % (len(data), extension, data)


# Content in one chunk each, two events in one chunk, one event split over two chunks,
# a chunk extension, then the finish, usage and [DONE] together and a trailer.
FIVE = event(5, " t5")
PARTS = [
    HEAD,
    chunk(event(0, " t0", role="assistant")),
    chunk(event(1, " t1")),
    chunk(event(2, " t2") + event(3, " t3")),
    chunk(event(4, " t4"), b";ext=1"),
    chunk(FIVE[:20]),
    chunk(FIVE[20:]),
    chunk(event(5, None) + usage(6) + b"data: [DONE]\n\n"),
    b"0\r\nx-trailer: 1\r\n\r\n",
]
STREAM = b"".join(PARTS)
TEXT = "".join(f" t{i}" for i in range(6))


def start() -> tuple[_StreamProtocol, FakeTransport, asyncio.Future[Any]]:
    proto = _StreamProtocol()
    transport = FakeTransport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    return proto, transport, proto.send(b"POST / HTTP/1.1\r\n\r\n")


def run(pieces: list[bytes]) -> tuple[Sample, _StreamProtocol]:
    proto, _, done = start()
    for piece in pieces:
        assert not done.done()
        proto.data_received(piece)
    assert done.done()
    return done.result().sample(), proto


def splits(data: bytes) -> Iterator[list[bytes]]:
    """Every split into two pieces, one-byte pieces, and (for the stream) one read per
    server write (what the gateway sends)."""
    if data == STREAM:
        yield PARTS
    for i in range(1, len(data)):
        yield [data[:i], data[i:]]
    yield [data[i : i + 1] for i in range(len(data))]


async def test_a_chunked_stream_split_anywhere_gives_the_same_sample() -> None:
    for pieces in splits(STREAM):
        sample, proto = run(pieces)
        assert sample.ok, sample.error
        assert sample.text == TEXT and sample.output_tokens == 6 and sample.prompt_tokens == 7
        assert sample.events == 8 and len(sample.itl_s) == 5
        assert proto.reusable


async def test_each_event_is_timed_when_its_last_bytes_arrive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = iter(range(100))
    monkeypatch.setattr(sse_client, "perf_counter", lambda: float(next(clock)))
    proto, _, done = start()  # the request is sent at 0
    both = event(2, " b") + event(3, " c")
    for piece in (
        HEAD + chunk(event(1, " a"))[:30],  # 1: the first event is not complete yet
        chunk(event(1, " a"))[30:] + chunk(both)[:-40],  # 2: " a" ends, " b" ends
        chunk(both)[-40:],  # 3: " c" ends, in the same chunk as " b"
        chunk(usage(3)) + b"0\r\n\r\n",  # 4: the end
    ):
        proto.data_received(piece)
    sample = done.result().sample()
    assert sample.ok and sample.text == " a b c"
    assert sample.ttft_s == 2.0 and sample.itl_s == [0.0, 1.0] and sample.e2e_s == 4.0


async def test_a_content_length_body() -> None:
    body = event(0, " x") + event(1, " y") + usage(2) + b"data: [DONE]\n\n"
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
    for pieces in splits(head + body):
        sample, proto = run(pieces)
        assert sample.ok and sample.text == " x y" and sample.output_tokens == 2
        assert proto.reusable


async def test_a_non_200_reply_is_an_error_with_its_body() -> None:
    body = b'{"error": {"message": "no such model"}}'
    sample, _ = run([b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n" % len(body) + body])
    assert not sample.ok and sample.error.startswith("HTTP 404") and "no such model" in sample.error
    chunked = b"HTTP/1.1 503 Busy\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(b"x" * 600)
    sample, _ = run([chunked + b"0\r\n\r\n"])
    assert sample.error == f"HTTP 503: {b'x' * 400!r}"


async def test_keep_alive_reuses_the_connection_unless_the_server_closes_it() -> None:
    proto, transport, done = start()
    proto.data_received(STREAM)
    assert done.result().sample().ok and proto.reusable
    again = proto.send(b"POST / HTTP/1.1\r\n\r\n")
    proto.data_received(
        STREAM.replace(b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 200 OK\r\nConnection: close\r\n")
    )
    assert again.result().sample().text == TEXT
    assert not proto.reusable and len(transport.written) == 2


async def test_bad_json_and_error_events_end_the_sample() -> None:
    sample, _ = run([HEAD + chunk(event(0, " a") + b"data: {nope\n\n") + b"0\r\n\r\n"])
    assert not sample.ok and sample.error.startswith("JSONDecodeError")
    error = b'data: {"error": {"message": "engine died"}}\n\n'
    sample, _ = run([HEAD + chunk(event(0, " a") + error + event(1, " b")) + b"0\r\n\r\n"])
    assert sample.error == "engine died" and sample.text == " a" and not sample.itl_s


async def test_a_long_stream_is_parsed_as_it_goes() -> None:
    events = [chunk(event(i, " t")) for i in range(3 * sse_client._MAX_PENDING_SEGMENTS)]
    sample, _ = run([HEAD, *events, chunk(usage(len(events))), b"0\r\n\r\n"])
    assert sample.ok and sample.output_tokens == len(events) == len(sample.itl_s) + 1


async def test_malformed_framing_fails_the_request_and_closes_the_connection() -> None:
    for bad in (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # not a size
        HEAD + b"3\r\nabcXY",  # no CRLF after the chunk
        b"SPDY/3 200 OK\r\n\r\n",  # not HTTP/1.x
    ):
        proto, transport, done = start()
        proto.data_received(bad)
        assert done.done() and isinstance(done.exception(), ValueError | ProtocolViolation)
        assert transport.closed and not proto.reusable
    proto, transport, done = start()
    proto.data_received(STREAM + b"HTTP/1.1 200 OK\r\n")  # bytes after the response
    assert done.result().sample().ok and transport.closed and not proto.reusable
