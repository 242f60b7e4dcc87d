"""Resumable streams: ``GET /v1/chat/completions/{id}/events`` with ``Last-Event-ID``.

Every SSE event of a reply carries ``id: <seq>``. A client that lost its connection (or
was cut off for reading too slowly) asks for the events after the last id it saw; they are
replayed from the request's log and the stream continues live by blocking reads on that
same log, so it works from any gateway process, not only the one that took the request.
Only the tenant that made the request may read it; anyone else gets a 404. A replay asked
for keep-alives sends an SSE comment whenever the log has been quiet that long (a reply
still waiting in the queue), as a live stream does before its first token.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, replace
from dataclasses import fields as dataclass_fields
from typing import Any

import redis.asyncio as aioredis
from fastapi.responses import StreamingResponse

from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import Chunk
from cluster.wire.replylog import REPLY_FIELD
from cluster.wire.vocabulary import DropReason
from gateway.http.errors import BadRequest, GatewayTimeout, NotFound, refused
from gateway.streaming.response import EndingResponse
from gateway.streaming.sse import (
    DONE,
    KEEPALIVE,
    KEEPALIVE_END,
    ChunkFormatter,
    ReplyKind,
    error_event,
    whole_body,
)
from gateway.streaming.tool_calls import ToolMode


@dataclass(frozen=True, slots=True)
class RequestMeta:
    """Who made a request and how its reply is rendered (stored beside its log)."""

    tenant: str
    completion_id: str
    model: str
    created: int
    include_usage: bool
    continuous_usage: bool = False  # usage so far on every chunk
    kind: ReplyKind = "chat"  # a chat completion, or a text completion
    tools: ToolMode | None = None  # how a chat's reply becomes tool calls
    echo: str = ""  # the text in front of the reply (the request's echo)

    def encode(self) -> bytes:
        """JSON for Redis."""
        # Field by field: dataclasses.asdict deep-copies every value, on every request.
        fields = {name: getattr(self, name) for name in _META_FIELDS}
        if self.tools is not None:
            fields["tools"] = asdict(self.tools)
        return json.dumps(fields).encode()

    @classmethod
    def decode(cls, raw: bytes) -> RequestMeta:
        """From Redis JSON."""
        fields = json.loads(raw)
        tools = fields.pop("tools", None)
        return cls(**fields, tools=ToolMode(**tools) if tools else None)


_META_FIELDS = tuple(f.name for f in dataclass_fields(RequestMeta))


def reply_body(meta: RequestMeta, text: str, final: Chunk) -> dict[str, Any]:
    """The whole (non-streamed) reply's body, as its kind frames it."""
    return whole_body(
        meta.kind,
        meta.completion_id,
        meta.model,
        meta.created,
        [(text, final)],
        meta.tools,
        meta.echo,
    )


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


async def follow(
    redis: aioredis.Redis, keys: Keys, request_id: str, after_seq: int, idle_timeout_s: float
) -> AsyncIterator[Chunk]:
    """Every chunk of a reply after ``after_seq``, from its log, then live as the worker
    appends them, until the final one. ``TimeoutError`` when nothing arrives for
    ``idle_timeout_s``."""
    async for chunk in _follow(redis, keys, request_id, after_seq, idle_timeout_s):
        if chunk is not None:
            yield chunk


async def _follow(
    redis: aioredis.Redis, keys: Keys, request_id: str, after_seq: int, idle_timeout_s: float
) -> AsyncIterator[Chunk | None]:
    """:func:`follow`, and None after each blocking read that brought nothing."""
    reply_log_key = keys.reply_log(request_id)
    cursor = "0-0"
    idle_ms = 0.0
    block_ms = 1000
    while True:
        answer: Any = await redis.xread({reply_log_key: cursor}, count=256, block=block_ms)
        if not answer:
            idle_ms += block_ms
            if idle_ms >= idle_timeout_s * 1000:
                raise TimeoutError("the reply stopped arriving")
            yield None
            continue
        idle_ms = 0.0
        for entry_id, fields in answer[0][1]:
            cursor = entry_id
            chunk = protocol.decode_as(fields[REPLY_FIELD], Chunk)
            if chunk.seq <= after_seq:
                continue
            yield chunk
            if chunk.is_final:
                return


async def replay(
    redis: aioredis.Redis,
    keys: Keys,
    request_id: str,
    meta: RequestMeta,
    after_seq: int,
    idle_timeout_s: float,
    keepalive_s: float = 0.0,
) -> AsyncIterator[bytes]:
    """SSE bytes for every chunk after ``after_seq``, from the log, then live; with
    ``keepalive_s``, a keep-alive comment whenever nothing was sent for that long."""
    fmt = ChunkFormatter(
        meta.completion_id,
        meta.model,
        meta.created,
        meta.include_usage,
        role_sent=after_seq > 0,
        event_ids=True,
        continuous_usage=meta.continuous_usage,
        kind=meta.kind,
        tools=meta.tools,
        echo=meta.echo if after_seq == 0 else "",
    )
    lead = b""  # after keep-alives, KEEPALIVE_END goes with the next event (see sse.py)
    sent_s = time.monotonic()
    try:
        async for chunk in _follow(redis, keys, request_id, after_seq, idle_timeout_s):
            if chunk is None:
                if keepalive_s and time.monotonic() - sent_s >= keepalive_s:
                    yield KEEPALIVE
                    lead, sent_s = KEEPALIVE_END, time.monotonic()
                continue
            yield lead + fmt.render(chunk) if lead else fmt.render(chunk)
            lead, sent_s = b"", time.monotonic()
    except TimeoutError:
        yield lead + error_event(GatewayTimeout("the reply stopped arriving").body()) + DONE


async def collect(
    redis: aioredis.Redis, keys: Keys, request_id: str, idle_timeout_s: float
) -> tuple[str, Chunk]:
    """A whole reply from its log (waiting for the rest), and its final chunk."""
    parts: list[str] = []
    logprobs: list[Any] = []
    final: Chunk | None = None
    try:
        async for chunk in follow(redis, keys, request_id, 0, idle_timeout_s):
            parts.append(chunk.text)
            logprobs.extend(chunk.logprobs)
            final = chunk
    except TimeoutError as exc:
        raise GatewayTimeout("the reply stopped arriving") from exc
    assert final is not None
    # The whole reply's logprobs ride on its final chunk.
    return "".join(parts), replace(final, logprobs=logprobs) if logprobs else final


class Readers:
    """Bounds the replies read from their logs at once (the resume route, and a request
    attached to another's reply by its idempotency key): in all, and per tenant.

    Each reader holds a Redis connection in a blocking read, so readers get a connection
    pool of their own (``redis``), as large as the bound: however many readers a tenant
    opens, the connections the chat path needs are never theirs. A reader is counted before
    anything waits on that pool, and its request's metadata is read through the main
    connections (``lookup``), so a reader past the bound is refused at once instead of
    queueing for a connection the admitted readers hold.
    """

    def __init__(self, redis: aioredis.Redis, max_readers: int, lookup: aioredis.Redis) -> None:
        self.redis = redis
        self._lookup = lookup
        self._max = max_readers
        self._open = 0
        self._by_tenant: dict[str, int] = {}

    async def begin(self, keys: Keys, request_id: str, tenant: str, tenant_max: int) -> RequestMeta:
        """Admit one reader of ``tenant`` (429 past a bound) and return the request's
        metadata (404 when unknown or someone else's, the reader released)."""
        self.admit(tenant, tenant_max)
        try:
            return await load_meta(self._lookup, keys, request_id, tenant)
        except BaseException:
            self.release(tenant)
            raise

    def admit(self, tenant: str, tenant_max: int) -> None:
        """Count one more reader of ``tenant``; 429 when a bound is reached."""
        own = self._by_tenant.get(tenant, 0)
        if self._open >= self._max or (tenant_max and own >= tenant_max):
            raise refused(
                DropReason.TENANT_QUEUE_FULL if self._open < self._max else DropReason.QUEUE_FULL,
                "too many replies are being read from their logs at once; try again shortly",
                1000,
            )
        self._open += 1
        self._by_tenant[tenant] = own + 1

    def release(self, tenant: str) -> None:
        """One reader of ``tenant`` is done."""
        self._open -= 1
        left = self._by_tenant.get(tenant, 1) - 1
        if left > 0:
            self._by_tenant[tenant] = left
        else:
            self._by_tenant.pop(tenant, None)

    def response(
        self, tenant: str, body: AsyncIterator[bytes], headers: dict[str, str]
    ) -> StreamingResponse:
        """An SSE response that releases its reader when the response is over, whether
        its body ran, stopped early, or never started."""
        return _ReaderResponse(self, tenant, body, headers)


class _ReaderResponse(EndingResponse):
    def __init__(
        self, readers: Readers, tenant: str, body: AsyncIterator[bytes], headers: dict[str, str]
    ) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._readers = readers
        self._tenant = tenant

    def ended(self) -> None:
        """Give the tenant's reader back."""
        self._readers.release(self._tenant)
