"""Streams chunks from a worker back to the gateway that owns each request.

Every chunk goes two ways: ``XADD`` to the request's capped log stream (for gap repair,
resume and non-streaming replies), which expires after a TTL, and a ``PUBLISH`` to the
job's ``reply_to`` inbox (the live path, at-most-once). One flush is one Lua call per
:data:`MAX_CHUNKS_PER_CALL` chunks: it appends every chunk to its log, then publishes one
:class:`~cluster.wire.protocol.ChunkBatch` per gateway inbox. So an engine step of thousands of
streams costs the worker one command to pack and one reply to parse, and each gateway one
pub/sub message to read, instead of two or three commands and a message per stream.

Latency policy: a request's first chunk and its final chunk are sent at once. Later
tokens are coalesced: with ``publish_interval_ms == 0`` whatever accumulated while the
previous round trip was in flight goes in the next one (no added delay, natural
batching under load); with an interval, a request publishes at most once per interval.
All requests that are due are written in one round trip.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from cluster.runtime.tracing import Trace
from cluster.wire.keys import Keys
from cluster.wire.protocol import ChunkEncoder, Job
from cluster.wire.queue import ALLOW_OOM
from cluster.wire.replylog import REPLY_FIELD, REPLY_LOG_MAXLEN, REPLY_LOG_TTL_S
from workers.engines.base import EngineOutput

log = structlog.get_logger(__name__)

# Bounds one Lua call (Redis runs nothing else meanwhile): about a millisecond of XADDs.
MAX_CHUNKS_PER_CALL = 256

# KEYS: 1 the owners hash (job id -> the worker holding its lease), then the reply-log key of
# every chunk, in the order the payloads hold them. ARGV: 1 maxlen, 2 ttl_ms, 3 the log's
# field name, 4 this worker's id, 5 the reply-log key prefix, 6 the gateway-alive key
# prefix, 7 the inbox channel prefix, 8 the number n of inbox messages, then n (channel,
# payload) pairs, then the indices into KEYS of the logs whose TTL to set (first and final
# chunks).
# Each payload is an encoded ChunkBatch, [kind, version, [chunk, ...]] (cluster.wire.protocol);
# the script logs each chunk's bytes from it, so every chunk crosses the wire once. It
# reads the msgpack framing itself: the cmsgpack of Redis 7.0 rejects bin items ("Bad data
# format in input").
# Every chunk is logged before anything is published: whatever a client may have seen is
# then in the log, so a retry on another worker never repeats or skips text.
# Fenced by the lease: a chunk of a job whose lease another worker holds now (this one
# stalled past its lease, and the job moved on) is neither logged nor published; its job
# id comes back, for this worker to drop the job. A message published to nobody whose
# gateway's liveness key is gone comes back as its channel: nobody will read those replies.
# Returns {chunks logged, {fenced job ids}, {channels of gone gateways}}.
_PUBLISH = (
    ALLOW_OOM
    + """
local maxlen, ttl, field, me = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local log_prefix, alive_prefix, inbox_prefix = ARGV[5], ARGV[6], ARGV[7]
local n = tonumber(ARGV[8])
local byte, sub = string.byte, string.sub
local k, logged, fenced, gone = 1, 0, {}, {}
local function header(count)
  if count < 16 then return string.char(0x90 + count) end
  if count < 65536 then return string.char(0xdc, math.floor(count / 256), count % 256) end
  return string.char(0xdd, math.floor(count / 16777216) % 256, math.floor(count / 65536) % 256,
                     math.floor(count / 256) % 256, count % 256)
end
for j = 1, n do
  local payload = ARGV[8 + 2 * j]
  -- The items array's header follows the fixarray header, the kind (fixstr "chunks")
  -- and the version (fixint): 9 bytes. Each item is a msgpack bin 8, 16 or 32.
  local head, pos = byte(payload, 10), 11
  if head == 0xdc then pos = 13 elseif head == 0xdd then pos = 15 end
  local size = #payload
  local kept, dropped = {}, false
  while pos <= size do
    local start = pos
    local tag, a, b, c, d = byte(payload, pos, pos + 4)
    local len
    if tag == 0xc4 then
      len, pos = a, pos + 2
    elseif tag == 0xc5 then
      len, pos = a * 256 + b, pos + 3
    else
      len, pos = ((a * 256 + b) * 256 + c) * 256 + d, pos + 5
    end
    k = k + 1
    local id = sub(KEYS[k], #log_prefix + 1)
    local owner = redis.call('HGET', KEYS[1], id)
    if owner and owner ~= me then
      fenced[#fenced + 1] = id
      dropped = true
    else
      local chunk = sub(payload, pos, pos + len - 1)
      redis.call('XADD', KEYS[k], 'MAXLEN', '~', maxlen, '*', field, chunk)
      logged = logged + 1
      kept[#kept + 1] = sub(payload, start, pos + len - 1)
    end
    pos = pos + len
  end
  if dropped then
    -- Publish the chunks that were logged, framed again without the fenced ones.
    ARGV[8 + 2 * j] = sub(payload, 1, 9) .. header(#kept) .. table.concat(kept)
    if #kept == 0 then ARGV[8 + 2 * j] = '' end
  end
end
for j = 9 + 2 * n, #ARGV do
  redis.call('PEXPIRE', KEYS[tonumber(ARGV[j]) + 1], ttl)
end
for j = 1, n do
  local channel, payload = ARGV[7 + 2 * j], ARGV[8 + 2 * j]
  if payload ~= '' and redis.call('PUBLISH', channel, payload) == 0 then
    if redis.call('EXISTS', alive_prefix .. sub(channel, #inbox_prefix + 1)) == 0 then
      gone[#gone + 1] = channel
    end
  end
end
return {logged, fenced, gone}
"""
)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(slots=True)
class RequestStream:
    """Per-request publishing state: what was sent, and what waits to be sent."""

    job: Job
    worker_id: str
    queue_ms: float
    seq: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_ms: float = 0.0
    pending_text: list[str] = field(default_factory=list)
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    last_sent_s: float = 0.0
    # Set when the final chunk has been written to Redis.
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # The log's key, encoded once (set by the publisher on the first chunk).
    reply_log_key: bytes = b""
    # The job's span on this worker while tracing is on (cluster.runtime.tracing).
    trace: Trace | None = None

    @property
    def finished(self) -> bool:
        """True once the final chunk has been queued for sending."""
        return self.finish_reason is not None

    def add(self, out: EngineOutput) -> None:
        """Accumulate one engine step's output for this request."""
        self.pending_text.append(out.text)
        self.pending_ids.extend(out.token_ids)
        if out.logprobs:
            self.pending_logprobs.extend(out.logprobs)
        self.completion_tokens += len(out.token_ids)
        self.prompt_tokens = out.prompt_tokens
        self.cached_tokens = out.cached_tokens
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason

    def fail(self, code: str, message: str) -> None:
        """End this reply with an error (its next chunk is the final one)."""
        self.finish_reason = "error"
        self.error_code = code
        self.error_message = message

    def take(self, encoder: ChunkEncoder, sent_ms: float) -> bytes:
        """Turn everything pending into the next chunk, encoded."""
        self.seq += 1
        data = encoder.chunk(
            self.job.id,
            self.seq + self.job.resume_seq,
            "".join(self.pending_text),
            self.completion_tokens,
            self.prompt_tokens,
            self.finish_reason,
            self.error_code,
            self.error_message,
            self.cached_tokens,
            self.worker_id,
            self.queue_ms,
            self.prefill_ms,
            self.pending_ids,
            sent_ms,
            self.pending_logprobs,
        )
        self.pending_text.clear()
        self.pending_ids.clear()
        self.pending_logprobs.clear()
        return data


@dataclass(slots=True)
class Outgoing:
    """One encoded chunk on its way to Redis."""

    stream: RequestStream
    data: bytes
    # The stream's first chunk (of this worker) or its final one: both set the log's TTL.
    first: bool
    final: bool


class Publisher:
    """Owns the flush task that writes due chunks to Redis."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        interval_ms: float = 0.0,
        reply_log_ttl_s: int = REPLY_LOG_TTL_S,
        reply_log_maxlen: int = REPLY_LOG_MAXLEN,
        worker_id: str = "",
    ) -> None:
        self.worker_id = worker_id
        # Told the jobs whose chunks the lease fence refused (another worker owns them
        # now), and the inboxes of gateways that are gone.
        self.on_fenced: Callable[[list[str]], None] | None = None
        self.on_gateway_gone: Callable[[list[str]], None] | None = None
        self._redis = redis
        self._keys = keys
        self._interval_s = interval_ms / 1000.0
        self._reply_log_ttl_ms = reply_log_ttl_s * 1000
        self._reply_log_maxlen = reply_log_maxlen
        self._script = redis.register_script(_PUBLISH)
        self._dirty: dict[str, RequestStream] = {}
        self._unsent: list[Outgoing] = []
        self._encoder = ChunkEncoder()
        self._wake = asyncio.Event()
        self._flushed = asyncio.Event()
        self._sending = False
        self._failing = False
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the flush task."""
        self._task = asyncio.create_task(self._run(), name="publisher")

    async def close(self) -> None:
        """Flush what is pending, then stop."""
        if self._task is None:
            return
        await self.flush()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until everything marked so far has been written to Redis."""
        deadline = time.monotonic() + timeout_s
        while (self._dirty or self._unsent or self._sending) and time.monotonic() < deadline:
            self._wake.set()
            self._flushed.clear()
            try:
                await asyncio.wait_for(self._flushed.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                break

    def discard(self, request_id: str) -> None:
        """Drop everything not yet sent for ``request_id``: its job now belongs to another
        worker, which continues the reply from the log; a late chunk from here would
        repeat or contradict it."""
        self._dirty.pop(request_id, None)
        self._unsent = [o for o in self._unsent if o.stream.job.id != request_id]

    def mark(self, stream: RequestStream) -> None:
        """Note that ``stream`` has something to send; wake the flusher if it is due."""
        self._dirty[stream.job.id] = stream
        if self._is_due(stream, time.monotonic()):
            self._wake.set()

    def _is_due(self, stream: RequestStream, now_s: float) -> bool:
        # With no interval every marked stream is due (the clock never runs backwards).
        return stream.seq == 0 or stream.finished or now_s - stream.last_sent_s >= self._interval_s

    async def _run(self) -> None:
        while True:
            timeout = self._next_due_in()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass
            self._wake.clear()
            batch = self._collect(time.monotonic())
            if batch:
                self._sending = True
                try:
                    await self._send(batch)
                finally:
                    self._sending = False
            self._flushed.set()

    def _next_due_in(self) -> float | None:
        """Seconds until the earliest coalesced stream is due (None: nothing waits)."""
        if self._unsent:
            return 0.05
        if not self._dirty or self._interval_s == 0.0:
            return None
        now = time.monotonic()
        soonest = min(s.last_sent_s + self._interval_s for s in self._dirty.values())
        return max(0.0, soonest - now)

    def _collect(self, now_s: float) -> list[Outgoing]:
        batch, self._unsent = self._unsent, []
        sent_ms = time.time() * 1000.0  # one clock read per flush, not per chunk
        due = [s for s in self._dirty.values() if self._is_due(s, now_s)]
        if len(due) == len(self._dirty):
            self._dirty = {}
        else:
            for stream in due:
                del self._dirty[stream.job.id]
        for stream in due:
            stream.last_sent_s = now_s
            if not stream.reply_log_key:
                stream.reply_log_key = self._keys.reply_log(stream.job.id).encode()
            first = stream.seq == 0
            data = stream.take(self._encoder, sent_ms)
            batch.append(Outgoing(stream, data, first, stream.finished))
        return batch

    async def _send(self, batch: list[Outgoing]) -> None:
        written = 0
        error: RedisError | None = None
        try:
            while written < len(batch):
                part = batch[written : written + MAX_CHUNKS_PER_CALL]
                await self._send_part(part)
                written += len(part)
        except RedisError as exc:
            error = exc
        for out in batch[:written]:
            if out.final:
                out.stream.done.set()
            if out.first and out.stream.trace is not None:
                # When the first chunk reached Redis (and its gateway, a publish later).
                out.stream.trace.event("first chunk published")
        if error is not None:
            # Keep the chunks not yet written, in order, and try again: nothing is dropped,
            # and the parts already logged are not logged twice.
            if not self._failing:
                log.warning("publish failed, retrying", error=str(error), chunks=len(batch))
            self._failing = True
            self._unsent = batch[written:] + self._unsent
            await asyncio.sleep(0.05)
        elif self._failing:
            self._failing = False
            log.info("publishing again", chunks=len(batch))

    async def _send_part(self, part: list[Outgoing]) -> None:
        """Log and publish ``part`` in one Lua call."""
        inboxes: dict[str, list[Outgoing]] = {}
        for out in part:
            outs = inboxes.get(out.stream.job.reply_to)
            if outs is None:
                inboxes[out.stream.job.reply_to] = [out]
            else:
                outs.append(out)
        keys: list[bytes | str] = [self._keys.owners]
        expiring: list[int] = []
        args: list[bytes | str | int] = [
            self._reply_log_maxlen,
            self._reply_log_ttl_ms,
            REPLY_FIELD,
            self.worker_id,
            self._keys.reply_log(""),
            self._keys.gateway_alive(""),
            self._keys.inbox(""),
            len(inboxes),
        ]
        for channel, outs in inboxes.items():
            for out in outs:
                keys.append(out.stream.reply_log_key)
                if out.first or out.final:
                    expiring.append(len(keys) - 1)
            args.append(channel)
            args.append(self._encoder.batch([out.data for out in outs]))
        args.extend(expiring)
        _, fenced, gone = await self._script(keys=keys, args=args)
        if fenced and self.on_fenced is not None:
            self.on_fenced([_text(x) for x in fenced])
        if gone and self.on_gateway_gone is not None:
            self.on_gateway_gone([_text(x) for x in gone])
