"""Reading a request's reply log: the capped Redis stream every chunk is appended to.

The log is the at-least-once copy of what pub/sub delivers at most once. The gateway
fills gaps and resumes streams from it; a worker that takes over an orphaned job reads it
to learn which tokens already reached the client, so the retry continues the same reply.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import Chunk

LOG_FIELD = b"c"


async def read_log(
    redis: aioredis.Redis, keys: Keys, request_id: str, from_seq: int = 1
) -> list[Chunk]:
    """Chunks of ``request_id`` with ``seq >= from_seq``, in order (empty if none)."""
    entries = await redis.xrange(keys.log(request_id)) or []
    chunks = [
        protocol.decode_as(fields[LOG_FIELD], Chunk)  # type: ignore[arg-type]
        for _, fields in entries
        if fields
    ]
    return [c for c in chunks if c.seq >= from_seq]
