"""One chat request from the moment it is queued to its last byte.

A :class:`ChatCall` owns everything a request holds while its reply is on its way: the
reply stream registered with the inbox, the metrics timer with the one summary log line,
and the right to cancel the job. Every way a request can end (its final chunk, an error,
a timeout, a slow reader, a client that left) goes through :meth:`ChatCall.end`, once: it
records the outcome, releases the reply stream, and cancels the job if the reply may still
be running and nobody will read it (a resumable request keeps running for its client to
come back).

A streamed reply hands the call to its response (:meth:`ChatCall.stream`), which ends it
when the body ends, or when the body never starts because the client left first.

The status of a reply waits for its first chunk, so an error before any token is a 4xx or
5xx with its JSON body. A streamed request still waiting after the keep-alive interval
(``sse_keepalive_s``; a request waiting in the queue) gets its 200 then, and SSE comments
every interval until its first token, so that no idle timeout between the client and the
gateway cuts it; an error after that point is an SSE error event, as mid-stream errors
are. Fast requests and early refusals are answered exactly as without keep-alives.

With tracing on, the call also owns the request's span (:mod:`cluster.runtime.tracing`):
the enqueue, the wait in the queue and the first token are recorded under it, and
:meth:`ChatCall.end` ends it.

A request no worker takes by its deadline (every slot busy, or no batch room for a batch
job) is not left waiting for the request timeout: shortly after its deadline the call
withdraws it from the queue, if it is still there, and the client gets the same 429
``expired`` a worker would have sent on claiming it late.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import replace
from typing import Any

import structlog
from fastapi.responses import StreamingResponse
from redis.exceptions import OutOfMemoryError, RedisError
from starlette.types import Send

from cluster.errors import Disconnected
from cluster.runtime.clock import RedisClock
from cluster.runtime.tracing import Trace
from cluster.wire.protocol import Chunk, Job
from cluster.wire.queue import Enqueued, JobQueue, Share
from cluster.wire.retry import retry_headers
from cluster.wire.vocabulary import DropReason, ErrorCode, Outcome
from gateway.http.errors import (
    APIError,
    GatewayTimeout,
    ServiceUnavailable,
    SlowClient,
    from_worker,
    refused,
)
from gateway.http.handlers import redis_unavailable
from gateway.metrics import GatewayMetrics
from gateway.streaming.relay import Inbox, SlowConsumer
from gateway.streaming.response import EndingResponse, wait_disconnect
from gateway.streaming.resume import RequestMeta
from gateway.streaming.socket_writer import ConnectionWriter
from gateway.streaming.sse import DONE, KEEPALIVE, KEEPALIVE_END, ChunkFormatter, error_event

log = structlog.get_logger(__name__)

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
# Called with the whole text and the final chunk once a reply completed, before its last
# event is written (a session records the turn, so the client's next turn sees it).
OnComplete = Callable[[str, Chunk], Awaitable[None]]

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# How long after its deadline a job no worker has claimed is withdrawn (a worker that
# claims it late answers ``expired`` itself well within this).
EXPIRY_GRACE_S = 1.0


class ClientGone(Disconnected):
    """The client disconnected before the reply started."""


async def _outwait(work: asyncio.Future[Any], receive: Receive, timeout_s: float | None) -> bool:
    """Wait for ``work`` (up to ``timeout_s``) unless the client disconnects first (then
    raise ClientGone). True when it is done; False when the time ran out (it runs on)."""
    gone = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({work, gone}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work.done():
        return True
    if gone.done():
        raise ClientGone
    return False


async def race_disconnect(awaitable: Awaitable[Any], receive: Receive) -> Any:
    """Await ``awaitable`` unless the client disconnects first (then raise ClientGone)."""
    work = asyncio.ensure_future(awaitable)
    try:
        await _outwait(work, receive, None)
    finally:
        if not work.done():
            work.cancel()
    if work.cancelled():
        raise ClientGone
    return work.result()


def queue_unavailable(exc: RedisError | None = None) -> APIError:
    """Redis did not answer (or is full): the client should retry (nothing was queued)."""
    if isinstance(exc, OutOfMemoryError):
        return redis_unavailable(exc)
    return ServiceUnavailable("the queue is unavailable", headers=retry_headers(1000))


class Canceller:
    """Sends cancels in the background: a call ends inside ``finally`` blocks and cancelled
    scopes, where nothing may be awaited."""

    def __init__(self, queue: JobQueue) -> None:
        self._queue = queue
        self._tasks: set[asyncio.Task[None]] = set()

    def cancel(self, job_id: str, reason: str) -> None:
        """Dequeue the job, or abort it on its worker (soon, not now)."""
        task = asyncio.get_running_loop().create_task(self._send(job_id, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, job_id: str, reason: str) -> None:
        try:
            outcome = await self._queue.cancel(job_id, reason)
            log.info("request cancelled", request_id=job_id, reason=reason, outcome=outcome)
        except RedisError as exc:
            log.warning("cancel failed", request_id=job_id, error=str(exc))


# An enqueue a cap refused: the drop reason and what the client reads.
_REFUSALS = {
    "queue_full": (DropReason.QUEUE_FULL, "the queue is full; try again shortly"),
    "tenant_queue_full": (
        DropReason.TENANT_QUEUE_FULL,
        "this tenant has as many requests waiting as its limits allow; try again shortly",
    ),
    "tenant_bytes_full": (
        DropReason.TENANT_QUEUE_FULL,
        "this tenant's waiting requests hold as many bytes as its limits allow",
    ),
}

# Why a job is cancelled when its call ends this way before the reply finished.
_CANCEL_REASONS = {
    Outcome.CANCELLED: "client_disconnected",
    Outcome.SLOW_CONSUMER: "slow_consumer",
    Outcome.TIMEOUT: "timeout",
    Outcome.ERROR: "failed",
}


class ChatCall:
    """One admitted request's reply, from enqueue to end (see the module docstring)."""

    def __init__(
        self,
        job: Job,
        *,
        inbox: Inbox,
        queue: JobQueue,
        metrics: GatewayMetrics,
        canceller: Canceller,
        stream: bool,
        resumable: bool,
        timeout_s: float,
        clock: RedisClock | None = None,
        user: str | None = None,
        trace: Trace | None = None,
        client_request_id: str | None = None,
    ) -> None:
        self.job = job
        # The request's span (None: tracing is off); ended by end().
        self._trace = trace
        # When the enqueue returned (wall clock ns; kept only while tracing).
        self._enqueued_ns = 0
        self._user = user  # the client's end user (OpenAI's ``user``), for abuse tracing
        self._client_request_id = client_request_id  # the client's X-Request-Id, a label
        self._clock = clock or RedisClock()
        self._inbox = inbox
        self._queue = queue
        self._metrics = metrics
        self._canceller = canceller
        self._resumable = resumable
        self._reply = inbox.open(job.id, job.tenant)
        self._chunks = self._reply.chunks(timeout_s)
        self._timer = metrics.request(job.priority_class, job.arrival_ms)
        self._first: Chunk | None = None
        self._last: Chunk | None = None
        self._stream = stream
        self._ended = False
        # Whether the job may be on the queue: from the enqueue until a reply says it was
        # not (a refusal, or an idempotent attach); a Redis error leaves it "maybe".
        self._maybe_queued = False
        # The wait for the first chunk, once first() ran out of patience: the response's
        # body takes it over (sending keep-alives meanwhile).
        self._waiting: asyncio.Future[Chunk] | None = None

    # -- the reply, chunk by chunk -------------------------------------------------------

    async def enqueue(
        self,
        meta: RequestMeta,
        meta_ttl_ms: int,
        prefer: str | None,
        prefer_ms: int,
        *,
        share: Share,
        max_waiting: int,
        idempotency: tuple[str, str] | None = None,
    ) -> Enqueued:
        """Queue the job (its reply stream is already registered, so nothing arrives
        unrouted). A queue or tenant cap refuses it with a 429 (503 if Redis does not
        answer); ``attached`` and ``conflict`` (the tenant's idempotency key names another
        job) are the caller's to serve."""
        self._maybe_queued = True
        started_ns = time.time_ns() if self._trace is not None else 0
        try:
            result = await self._queue.enqueue(
                self.job,
                meta.encode(),
                meta_ttl_ms=meta_ttl_ms,
                prefer=prefer,
                prefer_ms=prefer_ms,
                share=share,
                gateway=self._inbox.gateway_id,
                resumable=self._resumable,
                max_waiting=max_waiting,
                idempotency=idempotency,
            )
        except RedisError as exc:
            if self._trace is not None:
                self._trace.child("enqueue", started_ns, error=str(exc))
            raise queue_unavailable(exc) from exc
        if self._trace is not None:
            self._enqueued_ns = time.time_ns()
            self._trace.child(
                "enqueue", started_ns, self._enqueued_ns, {"charserve.enqueue": result.status}
            )
        self._maybe_queued = result.status == "queued"
        if result.status == "queued":
            self._reply.enqueued = True
        elif result.status in _REFUSALS:
            reason, message = _REFUSALS[result.status]
            self._metrics.rejected(self.job.priority_class, reason)
            raise refused(reason, message, 1000)
        return result

    def _note(self, chunk: Chunk) -> None:
        """A chunk written to (or collected for) the client."""
        self._timer.on_chunk(chunk)
        self._first = self._first or chunk
        self._last = chunk

    async def first(self, receive: Receive, patience_s: float | None = None) -> Chunk | None:
        """The first chunk, while watching for the client to leave; an error that happens
        before any token (an expired deadline, a parameter the engine rejects) is raised
        as the error the client gets, with its status.

        With ``patience_s``, None when no chunk came within it: the wait goes on, for
        :meth:`stream` to take over (the reply's status is then 200, whatever comes)."""
        waiting = asyncio.ensure_future(self._first_in_time())
        try:
            arrived = await _outwait(waiting, receive, patience_s)
        except BaseException:
            waiting.cancel()
            raise
        if not arrived:
            self._waiting = waiting  # the response's body waits on, with keep-alives
            return None
        try:
            chunk = waiting.result()
        except TimeoutError as exc:
            raise GatewayTimeout("no reply from any worker in time") from exc
        self._took_first(chunk)
        if chunk.error_code is not None:
            self.end(Outcome.of_error(chunk.error_code))
            raise from_worker(chunk.error_code, chunk.error_message)
        return chunk

    def _took_first(self, chunk: Chunk) -> None:
        """Note the first chunk (the TTFT, the queue wait; an expiry counts as a refusal)."""
        self._note(chunk)
        if chunk.error_code == ErrorCode.EXPIRED:
            self._metrics.rejected(self.job.priority_class, DropReason.EXPIRED)
        if self._trace is not None:
            self._trace_first(chunk)

    def _trace_first(self, chunk: Chunk) -> None:
        """The queue wait (from the enqueue to the claim, which the worker measured on
        Redis's clock as ``queue_ms`` after arrival) and the first chunk's event."""
        assert self._trace is not None
        now_ns = time.time_ns()
        if self._enqueued_ns:
            end_ns = now_ns
            if chunk.worker_id:  # claimed: the claim, on this machine's clock
                claimed_ms = self.job.arrival_ms + chunk.queue_ms - self._clock.offset_ms
                end_ns = min(now_ns, max(self._enqueued_ns, int(claimed_ms * 1_000_000)))
            self._trace.child(
                "queue wait",
                self._enqueued_ns,
                end_ns,
                {"charserve.queue_ms": chunk.queue_ms, "charserve.worker_id": chunk.worker_id},
            )
        self._trace.event(
            "first token" if chunk.error_code is None else "error before first token",
            {
                "charserve.prefill_ms": chunk.prefill_ms,
                "charserve.error_code": chunk.error_code or "",
            },
            now_ns,
        )

    async def _first_in_time(self) -> Chunk:
        """The first chunk; or, when none has come by the job's deadline (plus a grace)
        and the job is still waiting, the job withdrawn and an ``expired`` chunk."""
        nxt = asyncio.ensure_future(anext(self._chunks))
        try:
            left_s = (self.job.deadline_ms - self._clock.now_ms()) / 1000 + EXPIRY_GRACE_S
            done, _ = await asyncio.wait({nxt}, timeout=max(0.0, left_s))
            if done:
                return nxt.result()
            try:
                withdrawn = await self._queue.withdraw(self.job.id)
            except RedisError:
                withdrawn = False  # unknown: the worker's answer (or the timeout) decides
            if not withdrawn:
                return await nxt  # claimed in time: its reply is on its way
            self._maybe_queued = False
            budget_ms = self.job.deadline_ms - self.job.arrival_ms
            return Chunk(
                request_id=self.job.id,
                seq=1,
                text="",
                completion_tokens=0,
                prompt_tokens=len(self.job.prompt_token_ids),
                finish_reason="error",
                error_code=ErrorCode.EXPIRED,
                error_message=f"no worker could start the request within its latency "
                f"budget ({budget_ms} ms)",
            )
        finally:
            if not nxt.done():
                nxt.cancel()

    async def arrival(self) -> Chunk:
        """The first chunk, error chunks included, for a caller that did not ask
        :meth:`first` (or whose :meth:`first` ran out of patience). ``TimeoutError`` when
        no reply came in time."""
        waiting = self._waiting or asyncio.ensure_future(self._first_in_time())
        self._waiting = waiting
        chunk = await waiting
        self._took_first(chunk)
        return chunk

    async def next_chunk(self) -> Chunk:
        """The reply's next chunk (``TimeoutError`` when it stopped arriving, ``SlowConsumer``
        when the client fell too far behind)."""
        chunk = await anext(self._chunks)
        self._note(chunk)
        return chunk

    async def whole(self, first: Chunk) -> tuple[str, Chunk]:
        """The rest of the reply after ``first``: its whole text, and its final chunk, which
        carries the whole reply's logprobs. The call goes on (see :meth:`collect`)."""
        parts, final = [first.text], first
        logprobs = list(first.logprobs)
        while not final.is_final:
            final = await self.next_chunk()
            parts.append(final.text)
            logprobs.extend(final.logprobs)
        return "".join(parts), replace(final, logprobs=logprobs) if logprobs else final

    async def collect(self, first: Chunk, receive: Receive) -> tuple[str, Chunk]:
        """The whole reply as one text, and its final chunk (the call ends with it)."""
        text, final = await race_disconnect(self.whole(first), receive)
        self.end(Outcome.of_error(final.error_code))
        if final.error_code is not None:
            raise from_worker(final.error_code, final.error_message)
        return text, final

    def stream(
        self,
        first: Chunk | None,
        fmt: ChunkFormatter,
        raw_send: Send | None,
        on_complete: OnComplete | None,
        headers: dict[str, str],
        keepalive_s: float = 0.0,
    ) -> StreamingResponse:
        """The SSE response; it owns the call from here on. ``first`` None: the first
        chunk is still on its way (:meth:`first` ran out of patience), and the response
        sends a keep-alive comment now and every ``keepalive_s`` until it comes."""
        body = self._events(first, fmt, raw_send, on_complete, keepalive_s)
        return _CallResponse(self, body, headers)

    async def _events(
        self,
        first: Chunk | None,
        fmt: ChunkFormatter,
        raw_send: Send | None,
        on_complete: OnComplete | None,
        keepalive_s: float,
    ) -> AsyncIterator[bytes]:
        parts: list[str] | None = [] if on_complete is not None else None
        lead = b""
        if first is None:
            # The head goes out with the first keep-alive: from here on the status is 200,
            # and an error before the first token is an error event, as one after it is.
            waiting = self._waiting
            assert waiting is not None
            if self._trace is not None:
                self._trace.event("keep-alives started")
            try:
                while True:
                    yield KEEPALIVE
                    done, _ = await asyncio.wait({waiting}, timeout=keepalive_s)
                    if done:
                        break
                first = waiting.result()
            except TimeoutError:
                self.end(Outcome.TIMEOUT)
                late = GatewayTimeout("no reply from any worker in time")
                yield KEEPALIVE_END + error_event(late.body()) + DONE
                return
            except Exception as exc:  # what first() would have answered with a 500
                log.exception("waiting for the first chunk failed", request_id=self.job.id)
                self.end(Outcome.ERROR)
                failed = APIError(f"the reply failed: {exc}")
                yield KEEPALIVE_END + error_event(failed.body()) + DONE
                return
            self._took_first(first)
            lead = KEEPALIVE_END
        try:
            chunk = first
            while True:
                if parts is not None:
                    parts.append(chunk.text)
                if chunk.is_final:
                    if on_complete is not None and parts is not None and not chunk.error_code:
                        await on_complete("".join(parts), chunk)
                    self.end(Outcome.of_error(chunk.error_code))
                if lead:
                    yield lead + fmt.render(chunk)
                    lead = b""
                else:
                    yield fmt.render(chunk)
                if chunk.is_final:
                    return
                if chunk is first:
                    # The head and the first event are out: later content may go straight
                    # to the connection.
                    self._reply.direct = self._direct_sink(raw_send, fmt, parts)
                chunk = await self.next_chunk()
        except TimeoutError:
            self.end(Outcome.TIMEOUT)
            yield error_event(GatewayTimeout("the reply stopped arriving").body())
            yield DONE
        except SlowConsumer as exc:
            self.end(Outcome.SLOW_CONSUMER)
            if self._resumable:
                advice = (
                    f"the reply goes on: resume with GET /v1/chat/completions/"
                    f"chatcmpl-{self.job.id}/events and Last-Event-ID"
                )
            else:
                advice = "the reply was cancelled (send X-Resumable: true to resume instead)"
            yield error_event(SlowClient(f"{exc}; {advice}").body())
            yield DONE

    def _direct_sink(
        self, raw_send: Send | None, fmt: ChunkFormatter, parts: list[str] | None
    ) -> Callable[[Chunk], bool] | None:
        """What the relay calls to write one in-order content chunk straight to the
        client's connection (None: this server or response does not allow it). It does
        exactly what :meth:`_events` does for such a chunk: the event, the metrics, the
        text; any other chunk it leaves to the loop."""
        writer = ConnectionWriter.attach(raw_send)
        if writer is None:
            return None
        write, event, is_content, note = writer.write, fmt.content_event, fmt.is_content, self._note

        def sink(chunk: Chunk) -> bool:
            if not is_content(chunk) or not write(event(chunk.seq, chunk.text)):
                return False
            note(chunk)
            if parts is not None:
                parts.append(chunk.text)
            return True

        return sink

    # -- the end -------------------------------------------------------------------------

    def forget(self) -> None:
        """Release a call whose job was never queued (another request's reply serves it):
        nothing to count, nothing to cancel."""
        self._ended = True
        self._inbox.release(self.job.id)
        if self._trace is not None:
            self._trace.set({"charserve.outcome": "attached"})
            self._trace.end()

    def end(self, outcome: Outcome) -> None:
        """Record ``outcome``, release the reply stream, and cancel the job if its reply
        may still run for nobody. Only the first call does anything."""
        if self._ended:
            return
        self._ended = True
        self._inbox.release(self.job.id)
        if self._waiting is not None and not self._waiting.done():
            self._waiting.cancel()  # the client left while its first token was awaited
        finished = self._last is not None and self._last.is_final
        reason = _CANCEL_REASONS.get(outcome)
        if (
            self._maybe_queued
            and not finished
            and reason is not None
            and (outcome == Outcome.ERROR or not self._resumable)
        ):
            self._canceller.cancel(self.job.id, reason)
        if self._trace is not None:
            self._end_trace(outcome)
        if not self._timer.finish(outcome):
            return
        ttft = self._timer.ttft_s
        first, last = self._first, self._last
        log.info(
            "request finished",
            outcome=outcome,
            request_id=self.job.id,
            client_request_id=self._client_request_id,
            tenant=self.job.tenant,
            user=self._user,
            priority=self.job.priority_class,
            stream=self._stream,
            prompt_tokens=len(self.job.prompt_token_ids),
            e2e_ms=round(self._timer.elapsed_s * 1000, 1),
            ttft_ms=round(ttft * 1000, 1) if ttft is not None else None,
            queue_ms=round(first.queue_ms, 1) if first else None,
            prefill_ms=round(first.prefill_ms, 1) if first else None,
            worker_id=first.worker_id if first else None,
            completion_tokens=last.completion_tokens if last else 0,
        )

    def _end_trace(self, outcome: Outcome) -> None:
        """End the request's span with what the summary log line says."""
        assert self._trace is not None
        if not self._trace.recording:  # not sampled, or ended with the error raised
            return
        first, last, ttft = self._first, self._last, self._timer.ttft_s
        attributes: dict[str, str | float | int] = {
            "charserve.outcome": outcome.value,
            "gen_ai.usage.output_tokens": last.completion_tokens if last else 0,
        }
        if ttft is not None:
            attributes["charserve.ttft_ms"] = round(ttft * 1000, 1)
        if first is not None:
            attributes["charserve.worker_id"] = first.worker_id
        self._trace.set(attributes)
        error = None
        if outcome not in (Outcome.COMPLETED, Outcome.CANCELLED):
            error = (last.error_message if last and last.error_code else None) or outcome.value
        self._trace.end(error=error)


class _CallResponse(EndingResponse):
    """A streamed reply that ends its call when the response is over, whether its body
    ran to the end, stopped early, or never started (the client left before the head)."""

    def __init__(self, call: ChatCall, body: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        self._call = call

    def ended(self) -> None:
        """End the call (cancelled, unless it ended already)."""
        self._call.end(Outcome.CANCELLED)
