"""``POST /v1/chat/completions``: validate, render, admit, enqueue, relay.

The flow of one request: the model and options are checked and the prompt rendered (any
problem is a 4xx before anything is queued); the reply stream is registered with the
inbox; the job is enqueued. The handler waits for the first chunk while watching for a
client disconnect, so an error that happens before any token (an expired deadline, a
parameter the engine rejects) is still answered with a proper status. Then the reply is
streamed as SSE, or collected into one JSON body. A client that goes away at any point
cancels the job: dequeued if it waits, aborted in the engine if it runs.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import structlog
from fastapi.responses import JSONResponse, Response, StreamingResponse
from redis.exceptions import RedisError
from starlette.types import Send

from cluster.errors import Disconnected
from cluster.runtime.settings import Settings
from cluster.wire.protocol import Chunk, Job
from cluster.wire.queue import JobQueue
from cluster.wire.vocabulary import Outcome
from gateway.characters.persona_chat import PersonaChat, PersonaTurn
from gateway.chat.admission import Admission, Admitter
from gateway.chat.prompts import PromptBuilder
from gateway.chat.schemas import ChatCompletionRequest
from gateway.http.errors import (
    BadRequest,
    GatewayTimeout,
    NotFound,
    ServiceUnavailable,
    SlowClient,
    TooManyRequests,
    from_worker,
)
from gateway.http.middleware import Authenticator
from gateway.metrics import GatewayMetrics
from gateway.streaming.relay import Inbox, ReplyStream, SlowConsumer
from gateway.streaming.resume import RequestMeta
from gateway.streaming.socket_writer import ConnectionWriter
from gateway.streaming.sse import DONE, ChunkFormatter, completion_body, error_event

log = structlog.get_logger(__name__)

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


class ClientGone(Disconnected):
    """The client disconnected before the reply started."""


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _race_disconnect(awaitable: Awaitable[Any], receive: Receive) -> Any:
    """Await ``awaitable`` unless the client disconnects first (then raise ClientGone)."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    if work.done() and not work.cancelled():
        return work.result()
    raise ClientGone


_TOKEN_ID = re.compile(r"-?[0-9]+")


class _Tracker:
    """One request's metrics and its one summary log line (written once, at the end)."""

    def __init__(
        self, metrics: GatewayMetrics, request_id: str, tenant: str, job: Job, stream: bool
    ) -> None:
        self._timer = metrics.request(job.priority_class, job.arrival_ms)
        self._fields: dict[str, Any] = {
            "request_id": request_id,
            "tenant": tenant,
            "priority": job.priority_class,
            "stream": stream,
            "prompt_tokens": len(job.prompt_token_ids),
        }
        self._first: Chunk | None = None
        self._last: Chunk | None = None

    def chunk(self, chunk: Chunk) -> None:
        """Note a chunk written to (or collected for) the client."""
        self._timer.on_chunk(chunk)
        self._first = self._first or chunk
        self._last = chunk

    def finish(self, outcome: str) -> None:
        """Record the outcome (idempotent)."""
        if not self._timer.finish(outcome):
            return
        ttft = self._timer.ttft_s
        log.info(
            "request finished",
            outcome=outcome,
            e2e_ms=round(self._timer.elapsed_s * 1000, 1),
            ttft_ms=round(ttft * 1000, 1) if ttft is not None else None,
            queue_ms=round(self._first.queue_ms, 1) if self._first else None,
            worker_id=self._first.worker_id if self._first else None,
            completion_tokens=self._last.completion_tokens if self._last else 0,
            **self._fields,
        )


def _queue_unavailable() -> ServiceUnavailable:
    """Redis did not answer: the client should retry shortly (nothing was queued)."""
    return ServiceUnavailable("the queue is unavailable", headers={"Retry-After": "1"})


def _direct_sink(
    raw_send: Send | None, fmt: ChunkFormatter, tracker: _Tracker, parts: list[str] | None
) -> Callable[[Chunk], bool] | None:
    """What the relay calls to write one in-order content chunk straight to the client's
    connection (None: this server or response does not allow it). It does exactly what
    the streaming loop does for such a chunk: the event, the metrics, the persona text;
    any other chunk it leaves to the loop."""
    writer = ConnectionWriter.attach(raw_send)
    if writer is None:
        return None
    write, event, is_content = writer.write, fmt.content_event, fmt.is_content

    def sink(chunk: Chunk) -> bool:
        if not is_content(chunk) or not write(event(chunk.seq, chunk.text)):
            return False
        tracker.chunk(chunk)
        if parts is not None:
            parts.append(chunk.text)
        return True

    return sink


class ChatService:
    """Everything the chat route needs, built once per gateway process."""

    def __init__(
        self,
        settings: Settings,
        queue: JobQueue,
        inbox: Inbox,
        prompts: PromptBuilder,
        admitter: Admitter,
        auth: Authenticator | None = None,
        metrics: GatewayMetrics | None = None,
        persona: PersonaChat | None = None,
    ) -> None:
        self._settings = settings
        self._auth = auth
        self._persona = persona
        self._metrics = metrics or GatewayMetrics()
        self._admitter = admitter
        self._queue = queue
        self._inbox = inbox
        self._prompts = prompts
        self._cancels: set[asyncio.Task[Any]] = set()

    def check(self, request: ChatCompletionRequest) -> None:
        """Reject what this server cannot do, with the field at fault."""
        if request.model != self._settings.served_model_name:
            raise NotFound(
                f"The model `{request.model}` does not exist.",
                param="model",
                code="model_not_found",
            )
        if request.n != 1:
            raise BadRequest("only n=1 is supported", param="n")
        if len(request.messages) > self._settings.max_messages:
            raise BadRequest(
                f"at most {self._settings.max_messages} messages are accepted, "
                f"got {len(request.messages)}",
                param="messages",
                code="too_many_messages",
            )
        asked = request.max_completion_tokens or request.max_tokens
        bound = self._settings.max_completion_tokens
        if asked is not None and bound is not None and asked > bound:
            raise BadRequest(
                f"max_tokens is at most {bound} on this server, got {asked}",
                param="max_tokens",
                code="max_tokens_exceeded",
            )
        extra = request.model_extra or {}
        if extra.get("tools"):
            raise BadRequest("tools are not supported by this model", param="tools")
        if extra.get("logprobs"):
            raise BadRequest("logprobs are not supported", param="logprobs")
        for key in request.logit_bias or {}:
            if not _TOKEN_ID.fullmatch(key):
                raise BadRequest(
                    f"logit_bias keys must be token ids, not {key!r}", param="logit_bias"
                )

    async def complete(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        admission: Admission,
        tenant: str,
        receive: Receive,
        resumable: bool = False,
        raw_send: Send | None = None,
        event_ids: bool = False,
    ) -> Response:
        """Run one chat completion end to end. A ``resumable`` request keeps generating
        when its client goes away, so the client can come back for the rest; its events
        carry ``id:`` lines (as do those of a request that asks for ``event_ids``), others
        are framed exactly as OpenAI frames them. ``raw_send``
        is the server's own ``send`` for this request: with it, tokens may be written
        straight to the connection (see :mod:`gateway.streaming.socket_writer`)."""
        self.check(request)
        turn = await self._persona_turn(request, tenant)
        prompt = self._prompts.build(request, turn.messages if turn else None)
        rate = await self._charge(
            tenant, len(prompt.token_ids) + prompt.max_tokens, admission.priority_class
        )
        job = Job(
            id=request_id,
            reply_to=self._inbox.channel,
            model=request.model,
            prompt_token_ids=prompt.token_ids,
            max_tokens=prompt.max_tokens,
            sampling=request.sampling(),
            arrival_ms=admission.arrival_ms,
            deadline_ms=admission.deadline_ms,
            priority_class=admission.priority_class,
            tenant=tenant,
        )
        try:
            await self._admitter.admit(job)
        except RedisError as exc:
            raise _queue_unavailable() from exc
        tracker = _Tracker(self._metrics, request_id, tenant, job, request.stream)
        replies = self._inbox.open(request_id)
        chunks = replies.chunks(self._settings.request_timeout_s)
        handed_off = False
        try:
            meta = RequestMeta(
                tenant,
                f"chatcmpl-{request_id}",
                request.model,
                int(time.time()),
                request.include_usage,
            )
            try:
                await self._queue.enqueue(
                    job,
                    meta.encode(),
                    meta_ttl_ms=self._settings.reply_log_ttl_s * 1000,
                    prefer=turn.prefer if turn else None,
                    prefer_ms=self._settings.affinity_wait_ms,
                )
            except RedisError as exc:
                raise _queue_unavailable() from exc
            replies.enqueued = True
            first = await self._next(chunks, receive)
            tracker.chunk(first)
            if first.error_code is not None:
                tracker.finish(Outcome.of_error(first.error_code))
                if first.error_code == "expired":
                    self._metrics.rejected(job.priority_class, "expired")
                raise from_worker(first.error_code, first.error_message)
            if request.stream:
                fmt = ChunkFormatter(
                    meta.completion_id,
                    meta.model,
                    meta.created,
                    meta.include_usage,
                    event_ids=resumable or event_ids,
                )
                handed_off = True
                return StreamingResponse(
                    self._sse(replies, fmt, first, chunks, resumable, tracker, turn, raw_send),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **rate},
                )
            text, final = await _race_disconnect(self._collect(first, chunks, tracker), receive)
            tracker.finish(Outcome.of_error(final.error_code))
            if final.error_code is not None:
                raise from_worker(final.error_code, final.error_message)
            await self._record(turn, text, final)
            return JSONResponse(
                completion_body(meta.completion_id, meta.model, meta.created, text, final),
                headers=rate,
            )
        except ClientGone:
            tracker.finish("cancelled")
            if not resumable:
                self._cancel(request_id, "client_disconnected")
            return Response(status_code=499)
        except BaseException as exc:
            tracker.finish("timeout" if isinstance(exc, GatewayTimeout) else "error")
            self._cancel(request_id, "failed")
            raise
        finally:
            if not handed_off:
                self._inbox.release(request_id)

    async def _persona_turn(
        self, request: ChatCompletionRequest, tenant: str
    ) -> PersonaTurn | None:
        if self._persona is None:
            return None
        try:
            return await self._persona.resolve(
                request,
                tenant,
                self._prompts.requested_max_tokens(request),
                self._admitter.free_by_worker(),
            )
        except RedisError as exc:
            raise _queue_unavailable() from exc

    async def _record(self, turn: PersonaTurn | None, text: str, final: Chunk) -> None:
        """Append a completed persona turn to its session (never a failed one)."""
        if turn is None or final.error_code is not None:
            return
        try:
            await self._persona.completed(turn, text, final.worker_id)  # type: ignore[union-attr]
        except RedisError as exc:
            log.warning("could not record the turn", session_id=turn.session_id, error=str(exc))

    async def _charge(self, tenant: str, tokens: int, priority: str) -> dict[str, str]:
        """Take the request from the tenant's rate limits; the x-ratelimit headers."""
        if self._auth is None:
            return {}
        try:
            decision = await self._auth.take(tenant, tokens)
        except RedisError as exc:
            raise _queue_unavailable() from exc
        except TooManyRequests:
            self._metrics.rejected(priority, "rate_limited")
            raise
        return decision.headers() if decision else {}

    async def _next(self, chunks: AsyncIterator[Chunk], receive: Receive) -> Chunk:
        try:
            chunk: Chunk = await _race_disconnect(chunks.__anext__(), receive)
        except TimeoutError as exc:
            raise GatewayTimeout("no reply from any worker in time") from exc
        return chunk

    async def _collect(
        self, first: Chunk, chunks: AsyncIterator[Chunk], tracker: _Tracker
    ) -> tuple[str, Chunk]:
        parts = [first.text]
        final = first
        if not first.is_final:
            async for chunk in chunks:
                tracker.chunk(chunk)
                parts.append(chunk.text)
                final = chunk
        return "".join(parts), final

    async def _sse(
        self,
        replies: ReplyStream,
        fmt: ChunkFormatter,
        first: Chunk,
        chunks: AsyncIterator[Chunk],
        resumable: bool,
        tracker: _Tracker,
        turn: PersonaTurn | None,
        raw_send: Send | None,
    ) -> AsyncIterator[bytes]:
        request_id = replies.request_id
        finished = False
        parts: list[str] = []
        try:
            chunk = first
            while True:
                if turn is not None:
                    parts.append(chunk.text)
                    if chunk.is_final:
                        # Before the last event: the client's next turn sees this one.
                        await self._record(turn, "".join(parts), chunk)
                yield fmt.render(chunk)
                if chunk.is_final:
                    finished = True
                    tracker.finish(Outcome.of_error(chunk.error_code))
                    return
                if chunk is first:
                    # The head and the first event are out: later content may go straight
                    # to the connection.
                    replies.direct = _direct_sink(
                        raw_send, fmt, tracker, parts if turn is not None else None
                    )
                chunk = await anext(chunks)
                tracker.chunk(chunk)
        except TimeoutError:
            finished = True
            tracker.finish("timeout")
            yield error_event(GatewayTimeout("the reply stopped arriving").body())
            yield DONE
        except SlowConsumer as exc:
            tracker.finish("slow_consumer")
            yield error_event(
                SlowClient(
                    f"{exc}; resume with GET /v1/chat/completions/{request_id}/events and "
                    "Last-Event-ID"
                ).body()
            )
            yield DONE
        finally:
            self._inbox.release(request_id)
            tracker.finish("cancelled")
            if not finished and not resumable:
                self._cancel(request_id, "client_disconnected")

    def _cancel(self, request_id: str, reason: str) -> None:
        # A task, not an await: this runs inside cancelled scopes and finally blocks.
        task = asyncio.get_running_loop().create_task(self._safe_cancel(request_id, reason))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _safe_cancel(self, request_id: str, reason: str) -> None:
        try:
            outcome = await self._queue.cancel(request_id, reason)
            log.info("request cancelled", request_id=request_id, reason=reason, outcome=outcome)
        except RedisError as exc:
            log.warning("cancel failed", request_id=request_id, error=str(exc))
