"""A request's reply log: the capped Redis stream every chunk of its reply is appended to.

The log is the at-least-once copy of what pub/sub delivers at most once. The gateway
fills gaps and resumes streams from it; a worker that takes over an orphaned job reads it
to learn which tokens already reached the client, so the retry continues the same reply.
The worker writes it (:mod:`workers.loop.publisher`); both sides agree on its lifetime,
:data:`REPLY_LOG_TTL_S` unless configured, which is also how long a reply can be resumed.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import Chunk

# The stream entry's one field: an encoded Chunk.
REPLY_FIELD = b"c"
# How long a reply log (and its request's metadata) lives after its last chunk, seconds.
REPLY_LOG_TTL_S = 3600
# Entries kept per log (approximately: XADD MAXLEN ~).
REPLY_LOG_MAXLEN = 10_000


async def read_reply_log(
    redis: aioredis.Redis, keys: Keys, request_id: str, from_seq: int = 1
) -> list[Chunk]:
    """Chunks of ``request_id`` with ``seq >= from_seq``, in order (empty if none)."""
    entries = await redis.xrange(keys.reply_log(request_id)) or []
    chunks = [
        protocol.decode_as(fields[REPLY_FIELD], Chunk)  # type: ignore[arg-type]
        for _, fields in entries
        if fields
    ]
    return [c for c in chunks if c.seq >= from_seq]
