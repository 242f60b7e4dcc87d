"""The wire protocol: round trips, and clear errors for anything unexpected."""

from __future__ import annotations

import dataclasses
import inspect

import msgpack
import pytest

from cluster.wire import protocol
from cluster.wire.protocol import Cancel, Chunk, ChunkBatch, Job, ProtocolError, WorkerStats


def _job() -> Job:
    return Job(
        id="r1",
        reply_to="inbox",
        model="m",
        prompt_token_ids=[1, 2, 3],
        max_tokens=8,
        sampling={"temperature": 0.5, "stop": ["x"]},
        arrival_ms=10,
        deadline_ms=20,
    )


@pytest.mark.parametrize(
    "message",
    [
        _job(),
        Chunk(
            request_id="r1",
            seq=3,
            text="héllo",
            completion_tokens=4,
            prompt_tokens=9,
            finish_reason="stop",
            token_ids=[5, 6],
        ),
        Cancel(request_id="r1", reason="test"),
        WorkerStats(worker_id="w", max_slots=4, running=1, ts_ms=5, decode_tokens_per_s=1.5),
    ],
)
def test_round_trip(message: protocol.Message) -> None:
    assert protocol.decode(protocol.encode(message)) == message


def test_unknown_version_is_rejected() -> None:
    data = msgpack.packb(["cancel", 99, "r1", "x"])
    with pytest.raises(ProtocolError, match="unsupported cancel version 99"):
        protocol.decode(data)


def test_unknown_kind_and_garbage_are_rejected() -> None:
    with pytest.raises(ProtocolError, match="unknown message kind"):
        protocol.decode(msgpack.packb(["pickle", 1]))
    with pytest.raises(ProtocolError):
        protocol.decode(b"\xc1\xc1not msgpack")
    with pytest.raises(ProtocolError, match="malformed"):
        protocol.decode(msgpack.packb(["cancel", 1, "a", "b", "c", "d"]))


def test_decode_as_checks_the_type() -> None:
    with pytest.raises(ProtocolError, match="expected chunk, got cancel"):
        protocol.decode_as(protocol.encode(Cancel(request_id="r")), Chunk)


def test_free_slots_never_negative() -> None:
    assert WorkerStats(worker_id="w", max_slots=2, running=5, ts_ms=0).free_slots == 0


def test_a_chunk_batch_carries_whole_chunks() -> None:
    chunks = [
        Chunk(request_id=f"r{i}", seq=i + 1, text="x", completion_tokens=1, prompt_tokens=2)
        for i in range(3)
    ]
    data = protocol.encode(ChunkBatch([protocol.encode(c) for c in chunks]))
    assert protocol.decode_chunks(data) == chunks
    # A single chunk (a worker of an earlier build) is a batch of one.
    assert protocol.decode_chunks(protocol.encode(chunks[0])) == chunks[:1]


def test_a_chunk_batch_rejects_what_is_not_a_chunk() -> None:
    with pytest.raises(ProtocolError, match="expected chunks, got cancel"):
        protocol.decode_chunks(protocol.encode(Cancel(request_id="r")))
    with pytest.raises(ProtocolError, match="expected chunk, got cancel"):
        protocol.decode_chunks(protocol.encode(ChunkBatch([protocol.encode(Cancel("r"))])))
    with pytest.raises(ProtocolError, match="items must be encoded chunks"):
        protocol.decode_chunks(msgpack.packb(["chunks", protocol.VERSION, [1, 2]]))


def test_chunk_encoder_writes_the_bytes_of_encode() -> None:
    # Every field distinct from its default, so a field out of order cannot go unseen.
    chunk = Chunk(
        request_id="r1",
        seq=7,
        text=" héllo",
        completion_tokens=9,
        prompt_tokens=65,
        finish_reason="error",
        error_code="internal_error",
        error_message="boom",
        cached_tokens=3,
        worker_id="w-1",
        queue_ms=1.5,
        prefill_ms=2.25,
        token_ids=[4, 5],
        sent_ms=1_790_000_000_123.5,
    )
    encoder = protocol.ChunkEncoder()
    values = {f.name: getattr(chunk, f.name) for f in dataclasses.fields(chunk)}
    assert list(inspect.signature(encoder.chunk).parameters) == list(values)
    data = encoder.chunk(**values)
    assert data == protocol.encode(chunk)
    assert protocol.decode(data) == chunk
    plain = Chunk(request_id="r2", seq=1, text="", completion_tokens=0, prompt_tokens=0)
    assert encoder.chunk(**{f.name: getattr(plain, f.name) for f in dataclasses.fields(plain)}) == (
        protocol.encode(plain)
    )
    assert encoder.batch([data, data]) == protocol.encode(ChunkBatch([data, data]))
