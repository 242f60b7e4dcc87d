"""The inbox relay: one Redis pub/sub subscription per gateway process, dispatched into
bounded per-request queues.

Every job names this process's inbox channel as ``reply_to``, and the subscription is
made once at start-up, so no per-request subscribe round trip sits on the TTFT path.
Pub/sub is at-most-once: every chunk has a sequence number, and a gap is repaired from the
request's log stream, which the worker writes in the same round trip as it publishes.
Dispatch never blocks: a client that reads so slowly that its bounded queue fills is cut
off with a ``slow_consumer`` error (it can resume from the log), so one slow reader never
stalls the subscription or any other stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from cluster import protocol
from cluster.keys import Keys
from cluster.protocol import Chunk
from cluster.replylog import read_log

log = structlog.get_logger(__name__)


class SlowConsumer(Exception):
    """The client fell too far behind; its stream is cut off (it may resume from the log)."""


class ReplyStream:
    """The chunks of one request, in order, each exactly once."""

    def __init__(self, inbox: Inbox, request_id: str, maxsize: int) -> None:
        self.request_id = request_id
        self._inbox = inbox
        self._queue: asyncio.Queue[Chunk] = asyncio.Queue(maxsize)
        self._overflowed = False
        self._next_seq = 1

    def _deliver(self, chunk: Chunk) -> None:
        try:
            self._queue.put_nowait(chunk)
        except asyncio.QueueFull:
            # The client reads too slowly. Never block the dispatcher (that would stall
            # every other stream): cut this one off instead.
            self._overflowed = True

    async def chunks(self, idle_timeout_s: float) -> AsyncIterator[Chunk]:
        """Yield chunks in sequence order until the final one.

        Raises ``TimeoutError`` when nothing arrives for ``idle_timeout_s``, and
        :class:`SlowConsumer` once the reader has fallen a whole queue behind.
        """
        while True:
            if self._overflowed:
                raise SlowConsumer(f"the client fell more than {self._queue.maxsize} chunks behind")
            chunk = await asyncio.wait_for(self._queue.get(), idle_timeout_s)
            if chunk.seq < self._next_seq:
                continue  # already delivered from the log
            if chunk.seq > self._next_seq:
                # A chunk was lost on pub/sub: fill the gap from the log.
                for missing in await self._inbox.read_log(self.request_id, self._next_seq):
                    if missing.seq == self._next_seq and missing.seq < chunk.seq:
                        self._next_seq += 1
                        yield missing
                if chunk.seq != self._next_seq:
                    raise RuntimeError(
                        f"chunks {self._next_seq}..{chunk.seq - 1} of {self.request_id} "
                        "are lost (not in the log)"
                    )
            self._next_seq += 1
            yield chunk
            if chunk.is_final:
                return


class Inbox:
    """This process's inbox channel and its dispatcher."""

    def __init__(
        self, redis: aioredis.Redis, keys: Keys, gateway_id: str, queue_size: int = 1024
    ) -> None:
        self.channel = keys.inbox(gateway_id)
        self._redis = redis
        self._keys = keys
        self._queue_size = queue_size
        self._streams: dict[str, ReplyStream] = {}
        self._pubsub: aioredis.client.PubSub | None = None
        self._task: asyncio.Task[None] | None = None
        self.subscribed = asyncio.Event()

    async def start(self) -> None:
        """Subscribe (before any enqueue) and start dispatching."""
        self._pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        await self._pubsub.subscribe(self.channel)
        self.subscribed.set()
        self._task = asyncio.create_task(self._run(), name="inbox")

    async def close(self) -> None:
        """Stop dispatching and unsubscribe."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._pubsub is not None:
            await self._pubsub.aclose()

    def open(self, request_id: str) -> ReplyStream:
        """Register a request before it is enqueued, so no chunk can arrive unrouted."""
        stream = ReplyStream(self, request_id, self._queue_size)
        self._streams[request_id] = stream
        return stream

    def release(self, request_id: str) -> None:
        """Forget a request (done, failed or abandoned)."""
        self._streams.pop(request_id, None)

    @property
    def active(self) -> int:
        """Requests currently routed through this inbox."""
        return len(self._streams)

    async def read_log(self, request_id: str, from_seq: int) -> list[Chunk]:
        """Chunks of ``request_id`` with ``seq >= from_seq`` from its log, in order."""
        return await read_log(self._redis, self._keys, request_id, from_seq)

    async def _run(self) -> None:
        assert self._pubsub is not None
        while True:
            try:
                message = await self._pubsub.get_message(timeout=None)
            except RedisError as exc:
                self.subscribed.clear()
                log.warning("inbox connection lost, resubscribing", error=str(exc))
                await asyncio.sleep(0.2)
                continue
            if message is None:
                continue
            self.subscribed.set()
            try:
                chunk = protocol.decode_as(message["data"], Chunk)
            except protocol.ProtocolError as exc:
                log.warning("dropping bad inbox message", error=str(exc))
                continue
            stream = self._streams.get(chunk.request_id)
            if stream is not None:
                stream._deliver(chunk)
