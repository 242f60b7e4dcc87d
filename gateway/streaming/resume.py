"""Resumable streams: ``GET /v1/chat/completions/{id}/events`` with ``Last-Event-ID``.

Every SSE event of a reply carries ``id: <seq>``. A client that lost its connection (or
was cut off for reading too slowly) asks for the events after the last id it saw; they are
replayed from the request's log and the stream continues live by blocking reads on that
same log, so it works from any gateway process, not only the one that took the request.
Only the tenant that made the request may read it; anyone else gets a 404.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

import redis.asyncio as aioredis

from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import Chunk
from cluster.wire.replylog import REPLY_FIELD
from gateway.http.errors import BadRequest, GatewayTimeout, NotFound
from gateway.streaming.sse import DONE, ChunkFormatter, error_event


@dataclass(frozen=True, slots=True)
class RequestMeta:
    """Who made a request and how its reply is rendered (stored beside its log)."""

    tenant: str
    completion_id: str
    model: str
    created: int
    include_usage: bool

    def encode(self) -> bytes:
        """JSON for Redis."""
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> RequestMeta:
        """From Redis JSON."""
        return cls(**json.loads(raw))


async def load_meta(redis: aioredis.Redis, keys: Keys, request_id: str, tenant: str) -> RequestMeta:
    """The request's metadata, or 404 when it is unknown, expired, or someone else's."""
    raw: Any = await redis.get(keys.request_meta(request_id))
    meta = RequestMeta.decode(raw) if raw else None
    if meta is None or meta.tenant != tenant:
        raise NotFound(f"No request with id {request_id!r}.", param="id", code="not_found")
    return meta


def parse_last_event_id(value: str | None) -> int:
    """``Last-Event-ID`` as a sequence number (0: from the start)."""
    if value is None or value.strip() == "":
        return 0
    try:
        seq = int(value)
    except ValueError:
        seq = -1
    if seq < 0:
        raise BadRequest("Last-Event-ID must be a non-negative integer", param="Last-Event-ID")
    return seq


async def replay(
    redis: aioredis.Redis,
    keys: Keys,
    request_id: str,
    meta: RequestMeta,
    after_seq: int,
    idle_timeout_s: float,
) -> AsyncIterator[bytes]:
    """SSE bytes for every chunk after ``after_seq``, from the log, then live."""
    fmt = ChunkFormatter(
        meta.completion_id,
        meta.model,
        meta.created,
        meta.include_usage,
        role_sent=after_seq > 0,
        event_ids=True,
    )
    reply_log_key = keys.reply_log(request_id)
    cursor = "0-0"
    idle_ms = 0.0
    block_ms = 1000
    while True:
        answer: Any = await redis.xread({reply_log_key: cursor}, count=256, block=block_ms)
        if not answer:
            idle_ms += block_ms
            if idle_ms >= idle_timeout_s * 1000:
                yield error_event(GatewayTimeout("the reply stopped arriving").body())
                yield DONE
                return
            continue
        idle_ms = 0.0
        for entry_id, fields in answer[0][1]:
            cursor = entry_id
            chunk = protocol.decode_as(fields[REPLY_FIELD], Chunk)
            if chunk.seq <= after_seq:
                continue
            yield fmt.render(chunk)
            if chunk.is_final:
                return
