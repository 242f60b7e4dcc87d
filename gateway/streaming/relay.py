"""The inbox relay: one Redis pub/sub subscription per gateway process, dispatched into
bounded per-request queues.

Every job names this process's inbox channel as ``reply_to``, and the subscription is
made once at start-up, so no per-request subscribe round trip sits on the TTFT path.
Pub/sub is at-most-once: every chunk has a sequence number, and a gap is repaired from the
request's log stream, which the worker writes in the same round trip as it publishes. A
worker sends one message per engine step carrying the chunks of every stream this
gateway owns (:class:`~cluster.wire.protocol.ChunkBatch`).
Dispatch never blocks: a client that reads so slowly that its bounded queue fills is cut
off with a ``slow_consumer`` error (it can resume from the log), so one slow reader never
stalls the subscription or any other stream.

The token path is short: while a stream's reader waits with nothing queued, it may arm a
*direct sink* (:attr:`ReplyStream.direct`), and the dispatcher hands each next in-order
content chunk straight to it (the SSE writer puts the event on the client's socket) instead
of waking the reader's task once per token. Everything else (the first and final chunks,
errors, gaps, a client whose socket is backed up) takes the queue, in order.

Redis can go away. The subscription reconnects (and resubscribes) by itself; afterwards,
and every few seconds for streams that have gone quiet, the inbox *reconciles*: it reads
each stream's log (delivering what pub/sub dropped) and checks the job still exists. A job
that no longer exists and never logged its final chunk (a Redis that restarted without
its data) ends its stream with a ``lost`` error, so no accepted request waits forever.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from cluster.errors import Disconnected
from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.presence import Presence
from cluster.wire.protocol import Chunk
from cluster.wire.replylog import REPLY_FIELD, read_reply_log
from cluster.wire.vocabulary import ErrorCode

log = structlog.get_logger(__name__)


# A chunk with this seq (workers start at 1) tells a stream its job was lost.
LOST_SEQ = 0
# A gateway's liveness key lives this long without a refresh (ms).
PRESENCE_MS = 10_000


class SlowConsumer(Disconnected):
    """The client fell too far behind; its stream is cut off (it may resume from the log)."""


class ReplyStream:
    """The chunks of one request, in order, each exactly once."""

    def __init__(self, inbox: Inbox, request_id: str, maxsize: int) -> None:
        self.request_id = request_id
        self.tenant = ""
        self._inbox = inbox
        self._queue: asyncio.Queue[Chunk] = asyncio.Queue(maxsize)
        self._overflowed = False
        self._next_seq = 1
        self.enqueued = False
        # The watchdog's last look at _next_seq: unchanged since then means quiet.
        self.watched_seq = 0
        # Writes one in-order chunk to the client; False: it did not (a chunk it does not
        # write directly, or could not: the chunk then takes the queue). Armed by
        # chunks() only while its reader waits.
        self.direct: Callable[[Chunk], bool] | None = None
        self._armed: Callable[[Chunk], bool] | None = None

    def _deliver(self, chunk: Chunk) -> None:
        sink = self._armed
        # The final chunk always takes the queue: the reader must see its stream end.
        if (
            sink is not None
            and chunk.seq == self._next_seq
            and not chunk.is_final
            and self._sink(sink, chunk)
        ):
            self._next_seq += 1
            return
        # From here on the reader's task handles chunks in order, until it waits again.
        self._armed = None
        try:
            self._queue.put_nowait(chunk)
        except asyncio.QueueFull:
            # The client reads too slowly. Never block the dispatcher (that would stall
            # every other stream): cut this one off instead.
            self._overflowed = True

    def _sink(self, sink: Callable[[Chunk], bool], chunk: Chunk) -> bool:
        """Hand ``chunk`` to the direct sink; a sink that fails is dropped (the chunk and
        the rest of the stream take the queue): one broken stream never stops the
        dispatcher."""
        try:
            return sink(chunk)
        except Exception:
            log.exception("direct write failed", request_id=self.request_id)
            self.direct = None
            return False

    async def chunks(self, idle_timeout_s: float) -> AsyncIterator[Chunk]:
        """Yield chunks in sequence order until the final one.

        Raises ``TimeoutError`` when nothing arrives for ``idle_timeout_s``, and
        :class:`SlowConsumer` once the reader has fallen a whole queue behind.
        """
        while True:
            if self._overflowed:
                raise SlowConsumer(f"the client fell more than {self._queue.maxsize} chunks behind")
            if self._queue.empty():
                chunk = await self._wait(idle_timeout_s)
            else:
                chunk = self._queue.get_nowait()
            if chunk.seq == LOST_SEQ:
                yield dataclasses.replace(chunk, seq=self._next_seq)
                return
            if chunk.seq < self._next_seq:
                continue  # already delivered from the log
            if chunk.seq > self._next_seq:
                # A chunk was lost on pub/sub: fill the gap from the log.
                for missing in await self._inbox.read_reply_log(self.request_id, self._next_seq):
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

    async def _wait(self, idle_timeout_s: float) -> Chunk:
        """The next queued chunk; meanwhile the direct sink (if any) takes what it can.
        Only a reader that has to wait pays for a timer (no task per chunk); the timeout
        counts from the last chunk delivered either way."""
        while True:
            seen = self._next_seq
            self._armed = self.direct
            try:
                async with asyncio.timeout(idle_timeout_s):
                    return await self._queue.get()
            except TimeoutError:
                if self._next_seq == seen:
                    raise
            finally:
                self._armed = None


class Inbox:
    """This process's inbox channel and its dispatcher."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        gateway_id: str,
        queue_size: int = 1024,
        watchdog_s: float = 5.0,
        presence_ms: int = PRESENCE_MS,
    ) -> None:
        self.gateway_id = gateway_id
        self.channel = keys.inbox(gateway_id)
        self._presence_ms = presence_ms
        self._presence: asyncio.Task[None] | None = None
        self._watchdog_s = watchdog_s
        self._watchdog: asyncio.Task[None] | None = None
        self._recovery: asyncio.Task[None] | None = None
        self.redis = self._redis = redis
        self._liveness = Presence(redis)
        self.keys = self._keys = keys
        self._queue_size = queue_size
        self._streams: dict[str, ReplyStream] = {}
        self._by_tenant: dict[str, int] = {}
        self._pubsub: aioredis.client.PubSub | None = None
        self._task: asyncio.Task[None] | None = None
        self.subscribed = asyncio.Event()

    async def start(self) -> None:
        """Subscribe (before any enqueue) and start dispatching."""
        self._pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        await self._pubsub.subscribe(self.channel)
        self.subscribed.set()
        await self._announce()
        self._task = asyncio.create_task(self._run(), name="inbox")
        self._watchdog = asyncio.create_task(self._watch(), name="inbox-watchdog")
        self._presence = asyncio.create_task(self._stay_present(), name="inbox-presence")

    async def close(self) -> None:
        """Stop dispatching and unsubscribe."""
        tasks = [t for t in (self._task, self._watchdog, self._recovery, self._presence) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._pubsub is not None:
            await self._pubsub.aclose()
        try:
            # Gone: workers drop what only this process would have relayed.
            await self._redis.delete(self._keys.gateway_alive(self.gateway_id))
        except RedisError as exc:
            log.warning("could not withdraw the gateway's presence", error=str(exc))

    async def _announce(self) -> None:
        # Through a full Redis too (see cluster.wire.presence): workers drop the streams of
        # a gateway whose key expired.
        await self._liveness.announce(self._keys.gateway_alive(self.gateway_id), self._presence_ms)

    async def _stay_present(self) -> None:
        """Refresh this gateway's liveness key (a third of its TTL apart): while it lives,
        workers run the jobs only this gateway can relay; once it expires, they drop them
        (a resumable job runs on: any gateway can serve its log)."""
        while True:
            await asyncio.sleep(self._presence_ms / 3000)
            try:
                await self._announce()
            except RedisError as exc:
                log.warning("gateway presence not refreshed", error=str(exc))

    def open(self, request_id: str, tenant: str = "") -> ReplyStream:
        """Register a request before it is enqueued, so no chunk can arrive unrouted."""
        stream = ReplyStream(self, request_id, self._queue_size)
        stream.tenant = tenant
        self._streams[request_id] = stream
        self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + 1
        return stream

    def release(self, request_id: str) -> None:
        """Forget a request (done, failed or abandoned)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            # The sink holds the request's call, which holds this stream: let reference
            # counting free them now, not a later garbage collection.
            stream.direct = None
            left = self._by_tenant.get(stream.tenant, 1) - 1
            if left > 0:
                self._by_tenant[stream.tenant] = left
            else:
                self._by_tenant.pop(stream.tenant, None)

    def open_for(self, tenant: str) -> int:
        """Replies of ``tenant`` this inbox routes now."""
        return self._by_tenant.get(tenant, 0)

    @property
    def active(self) -> int:
        """Requests currently routed through this inbox."""
        return len(self._streams)

    async def read_reply_log(self, request_id: str, from_seq: int) -> list[Chunk]:
        """Chunks of ``request_id`` with ``seq >= from_seq`` from its log, in order."""
        return await read_reply_log(self._redis, self._keys, request_id, from_seq)

    async def _run(self) -> None:
        assert self._pubsub is not None
        while True:
            try:
                message = await self._pubsub.get_message(timeout=None)
            except RedisError as exc:
                if self.subscribed.is_set():
                    log.warning("inbox connection lost, resubscribing", error=str(exc))
                self.subscribed.clear()
                if self._recovery is None or self._recovery.done():
                    self._recovery = asyncio.create_task(self._recover(), name="inbox-recovery")
                await asyncio.sleep(0.2)
                continue
            if message is None:
                continue
            self.subscribed.set()
            try:
                chunks = protocol.decode_chunks(message["data"])
            except protocol.ProtocolError as exc:
                log.warning("dropping bad inbox message", error=str(exc))
                continue
            streams = self._streams
            for chunk in chunks:
                stream = streams.get(chunk.request_id)
                if stream is not None:
                    stream._deliver(chunk)

    async def _recover(self) -> None:
        """After a lost connection: once Redis answers and the subscription is back,
        reconcile every open stream (twice: chunks published while the resubscribe was in
        flight are in the log by the second pass)."""
        assert self._pubsub is not None
        while True:
            await asyncio.sleep(0.2)
            connection = self._pubsub.connection
            if connection is None or not connection.is_connected:
                continue
            try:
                await self._redis.ping()
            except RedisError:
                continue
            break
        try:
            # A Redis that restarted without its data forgot this gateway's presence:
            # until it is back, workers would drop the jobs only this gateway relays.
            await self._announce()
        except RedisError as exc:
            log.warning("gateway presence not restored", error=str(exc))
        self.subscribed.set()
        log.info("inbox resubscribed", streams=len(self._streams))
        for delay in (0.0, 1.0):
            await asyncio.sleep(delay)
            await self._reconcile_safely(list(self._streams.values()))

    async def _watch(self) -> None:
        """Every ``watchdog_s``, reconcile the streams that made no progress since the
        last look (the token path itself keeps no timestamps for this)."""
        while True:
            await asyncio.sleep(self._watchdog_s)
            quiet = []
            for stream in self._streams.values():
                if stream._next_seq == stream.watched_seq:
                    quiet.append(stream)
                stream.watched_seq = stream._next_seq
            if quiet and self.subscribed.is_set():
                await self._reconcile_safely(quiet)

    async def _reconcile_safely(self, streams: list[ReplyStream]) -> None:
        try:
            await self._reconcile([s for s in streams if s.enqueued])
        except RedisError as exc:
            log.warning("reconcile failed", error=str(exc))

    async def _reconcile(self, streams: list[ReplyStream]) -> None:
        """Deliver what each stream's log holds beyond what it has seen; end the stream
        with ``lost`` if its job is gone without a final chunk."""
        if not streams:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for stream in streams:
                # Job first, then log: a job is removed only after its final chunk is
                # logged, so "no job" read first means the log read next is complete.
                pipe.hexists(self._keys.jobs, stream.request_id)
                pipe.xrevrange(self._keys.reply_log(stream.request_id), count=1)
            replies = await pipe.execute()
        for i, stream in enumerate(streams):
            exists, last = replies[2 * i], replies[2 * i + 1]
            newest = protocol.decode_as(last[0][1][REPLY_FIELD], Chunk) if last else None
            if newest is not None and newest.seq >= stream._next_seq:
                for chunk in await self.read_reply_log(stream.request_id, stream._next_seq):
                    stream._deliver(chunk)
            if not exists and (newest is None or not newest.is_final):
                log.warning("request lost", request_id=stream.request_id)
                stream._deliver(
                    Chunk(
                        stream.request_id,
                        LOST_SEQ,
                        "",
                        0,
                        0,
                        finish_reason="error",
                        error_code=ErrorCode.LOST,
                        error_message="the request was lost (its queue restarted without "
                        "its data); retry it",
                    )
                )
