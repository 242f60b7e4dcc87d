"""``POST /v1/chat/completions`` up to the enqueue, then the reply.

The flow of one request, top to bottom in :meth:`ChatService.complete`: the model and
options are checked and the prompt rendered (any problem is a 4xx before anything is
queued); the tenant's rate limits are charged; the job is admitted against its latency
budget; then a :class:`~gateway.chat.call.ChatCall` takes the request over: it registers
the reply stream, enqueues the job, waits for the first chunk while watching for a client
that leaves, and streams the reply as SSE or collects it into one JSON body. A client that
goes away at any point cancels the job: dequeued if it waits, aborted in the engine if it
runs. A streamed request that waits longer than ``sse_keepalive_s`` gets its 200 and
keep-alive comments until its first token (:mod:`gateway.chat.call`).

With tracing on, each request is one span (a child of the client's ``traceparent``), with
the admission under it; the call records the rest and ends it.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import Awaitable, MutableMapping
from dataclasses import dataclass, replace
from typing import Any

import structlog
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError
from starlette.types import Send

from cluster.runtime import tracing
from cluster.runtime.settings import Settings
from cluster.runtime.tracing import Trace, incoming_trace
from cluster.wire.protocol import Chunk, Job
from cluster.wire.queue import Enqueued, JobQueue, Share
from cluster.wire.tenants import Limits
from cluster.wire.vocabulary import DropReason, Outcome, PriorityClass
from gateway.characters.persona_chat import PersonaChat, PersonaTurn
from gateway.chat.admission import Admission, Admitter
from gateway.chat.call import (
    SSE_HEADERS,
    Canceller,
    ChatCall,
    ClientGone,
    OnComplete,
    Receive,
    queue_unavailable,
    race_disconnect,
)
from gateway.chat.choices import Choices
from gateway.chat.prompts import (
    ON_LOOP_CHARS,
    Prompt,
    PromptBuilder,
    prompt_chars,
    template_messages,
)
from gateway.chat.schemas import ChatCompletionRequest, CompletionRequest, SamplingRequest
from gateway.chat.tools import tool_mode, tools_chars
from gateway.http.auth import Authenticator
from gateway.http.errors import (
    APIError,
    BadRequest,
    Conflict,
    GatewayTimeout,
    PermissionDenied,
    TooManyRequests,
    from_worker,
    refused,
)
from gateway.metrics import GatewayMetrics
from gateway.streaming.relay import Inbox
from gateway.streaming.resume import Readers, RequestMeta, collect, replay, reply_body
from gateway.streaming.sse import COMPLETION_ID_PREFIX, ChunkFormatter, ReplyKind, whole_body
from gateway.streaming.tool_calls import ToolMode

log = structlog.get_logger(__name__)

_TOKEN_ID = re.compile(r"-?[0-9]+")


async def never_disconnects() -> MutableMapping[str, Any]:
    """The ``receive`` of a request with no HTTP client (a batch line): it never leaves."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


@dataclass(frozen=True, slots=True)
class ChatContext:
    """Who asks, and how the reply goes back.

    A ``resumable`` request keeps generating when its client goes away, so the client can
    come back for the rest; its events carry ``id:`` lines (as do those of a request that
    asks for ``event_ids``), others are framed exactly as OpenAI frames them. ``raw_send``
    is the server's own ``send`` for this request: with it, tokens may be written straight
    to the connection (see :mod:`gateway.streaming.socket_writer`). ``request_id`` is the
    server's; ``client_request_id`` (the client's ``X-Request-Id``) is the request's
    idempotency key within its tenant: the same id again, while the reply lives, is served
    that reply (never a second job), or refused with 409 if the request differs.
    """

    request_id: str
    tenant: str
    admission: Admission
    receive: Receive = never_disconnects
    client_request_id: str | None = None
    resumable: bool = False
    event_ids: bool = False
    raw_send: Send | None = None


class ReplyResponse(JSONResponse):
    """A whole (non-streamed) reply; :attr:`reply` keeps its body for callers inside the
    gateway (the Batch API, session warm-ups and summaries), which need not parse it back."""

    def __init__(self, reply: dict[str, Any], headers: dict[str, str]) -> None:
        super().__init__(reply, headers=headers)
        self.reply = reply


def whole_reply(response: Response) -> dict[str, Any]:
    """The body of a reply :meth:`ChatService.complete` answered whole (a request that
    asks no stream, with no client to leave)."""
    assert isinstance(response, ReplyResponse), response
    return response.reply


def _digest(request: SamplingRequest, job: Job) -> str:
    """What makes two requests the same one: the body and the admission class."""
    canonical = request.model_dump_json() + "|" + job.priority_class
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


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
        *,
        readers: Readers | None = None,
    ) -> None:
        self._settings = settings
        # Attached requests read another's reply from its log, as resume readers do.
        self._readers = readers or Readers(inbox.redis, 64, inbox.redis)
        self._keys = inbox.keys
        self._auth = auth
        self._persona = persona
        self._metrics = metrics or GatewayMetrics()
        self._admitter = admitter
        self._queue = queue
        self._inbox = inbox
        self._prompts = prompts
        self._canceller = Canceller(queue)
        # None while tracing is off: then nothing below touches OpenTelemetry.
        self._tracing = tracing.configure(settings.tracing, tracing.GATEWAY_SERVICE)

    async def complete(self, request: ChatCompletionRequest, ctx: ChatContext) -> Response:
        """Run one chat completion end to end: an SSE response, or one JSON body."""
        trace = self._begin_trace("chat", request, ctx)
        if trace is None:
            return await self._complete(request, ctx, None)
        return await _traced(trace, self._complete(request, ctx, trace))

    async def _complete(
        self, request: ChatCompletionRequest, ctx: ChatContext, trace: Trace | None
    ) -> Response:
        self.check(request)
        if len(request.messages) > self._settings.max_messages:
            raise BadRequest(
                f"at most {self._settings.max_messages} messages are accepted, "
                f"got {len(request.messages)}",
                param="messages",
                code="too_many_messages",
            )
        tools = tool_mode(request.tools, request.tool_choice, self._settings.tool_parser)
        if tools is not None and ctx.resumable:
            raise BadRequest(
                "X-Resumable is not served with tool calls (a resumed stream could not "
                "rebuild the calls already sent): leave the header out",
                param="X-Resumable",
                code="unsupported_field",
            )
        turn = await self._persona_turn(request, ctx.tenant)
        prompt = await self._build_prompt(request, turn)
        echo = ""
        if request.echo and request.messages and request.messages[-1].role == "assistant":
            echo = request.messages[-1].text()  # vLLM's echo: the reply's own role only
        return await self._serve(request, prompt, ctx, "chat", turn, trace, tools, echo)

    async def complete_text(self, request: CompletionRequest, ctx: ChatContext) -> Response:
        """Run one text completion (``/v1/completions``) end to end, through the same
        admission, queue, relay, resume and tenancy as a chat."""
        trace = self._begin_trace("text_completion", request, ctx)
        if trace is None:
            return await self._complete_text(request, ctx, None)
        return await _traced(trace, self._complete_text(request, ctx, trace))

    async def _complete_text(
        self, request: CompletionRequest, ctx: ChatContext, trace: Trace | None
    ) -> Response:
        self.check(request)
        if isinstance(request.prompt, str) and len(request.prompt) > ON_LOOP_CHARS:
            prompt = await asyncio.to_thread(self._prompts.build_text, request)
        else:
            prompt = self._prompts.build_text(request)
        echo = ""
        if request.echo:
            prompt_text = request.prompt
            echo = (
                prompt_text if isinstance(prompt_text, str) else self._prompts.decode(prompt_text)
            )
        return await self._serve(request, prompt, ctx, "text", None, trace, echo=echo)

    def _begin_trace(
        self, operation: str, request: SamplingRequest, ctx: ChatContext
    ) -> Trace | None:
        """The request's span (None while tracing is off), a child of the client's
        trace headers when it sent them."""
        if self._tracing is None:
            return None
        return self._tracing.start(
            operation,
            parent=incoming_trace.get(),
            kind="server",
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.request.model": request.model,
                "charserve.request_id": ctx.request_id,
                "charserve.tenant": ctx.tenant,
                "charserve.priority": ctx.admission.priority_class,
                "charserve.stream": request.stream,
            },
        )

    async def _serve(
        self,
        request: SamplingRequest,
        prompt: Prompt,
        ctx: ChatContext,
        kind: ReplyKind,
        turn: PersonaTurn | None,
        trace: Trace | None = None,
        tools: ToolMode | None = None,
        echo: str = "",
    ) -> Response:
        """Charge, admit, enqueue and relay one request's reply, as ``kind`` frames it
        (``tools`` shapes it, ``echo`` goes in front of it)."""
        admitting_ns = time.time_ns() if trace is not None else 0
        if request.n > 1:
            _choices_allowed(ctx, turn)
        rate = await self._charge(
            ctx.tenant,
            len(prompt.token_ids) + request.n * prompt.max_tokens,
            ctx.admission.priority_class,
        )
        job = Job(
            id=ctx.request_id,
            reply_to=self._inbox.channel,
            model=request.model,
            prompt_token_ids=prompt.token_ids,
            max_tokens=prompt.max_tokens,
            sampling=request.sampling(),
            arrival_ms=ctx.admission.arrival_ms,
            deadline_ms=ctx.admission.deadline_ms,
            priority_class=ctx.admission.priority_class,
            tenant=ctx.tenant,
            resumable=ctx.resumable,
            traceparent=trace.traceparent if trace is not None else "",
        )
        limits = await self._limits(ctx.tenant)
        self._within_limits(job, limits, request.n)
        await self._admit(job, limits.max_running)
        if trace is not None:
            trace.set(
                {
                    "gen_ai.usage.input_tokens": len(job.prompt_token_ids),
                    "gen_ai.request.max_tokens": job.max_tokens,
                }
            )
            trace.child("admission", admitting_ns)
        meta = RequestMeta(
            ctx.tenant,
            f"{COMPLETION_ID_PREFIX[kind]}{job.id}",
            request.model,
            int(time.time()),
            request.include_usage,
            request.continuous_usage,
            kind,
            tools,
            echo,
        )
        share = Share(
            limits.weight, limits.max_waiting, limits.max_waiting_bytes, limits.max_running
        )
        if request.n > 1:
            return await self._serve_choices(request, job, meta, ctx, share, rate, trace)
        call = self._call(job, request, ctx, trace)
        idempotency = None
        if ctx.client_request_id is not None:
            idempotency = (ctx.client_request_id, _digest(request, job))
        try:
            enqueued = await call.enqueue(
                meta,
                self._settings.reply_log_ttl_s * 1000,
                turn.prefer if turn else None,
                self._settings.affinity_wait_ms,
                share=share,
                max_waiting=self._settings.max_queued,
                idempotency=idempotency,
            )
            if enqueued.status != "queued":
                call.forget()
                return await self._attach(request, ctx, enqueued, rate)
            keepalive_s = self._settings.sse_keepalive_s if request.stream else 0.0
            first = await call.first(ctx.receive, keepalive_s or None)
            if request.stream:
                fmt = ChunkFormatter(
                    meta.completion_id,
                    meta.model,
                    meta.created,
                    meta.include_usage,
                    event_ids=ctx.resumable or ctx.event_ids,
                    continuous_usage=meta.continuous_usage,
                    kind=kind,
                    tools=tools,
                    echo=echo,
                )
                on_complete = self._recorder(turn) if turn else None
                return call.stream(first, fmt, ctx.raw_send, on_complete, rate, keepalive_s)
            assert first is not None  # first() without patience always has the chunk
            text, final = await call.collect(first, ctx.receive)
        except ClientGone:
            call.end(Outcome.CANCELLED)
            return Response(status_code=499)
        except BaseException as exc:
            if trace is not None:
                _trace_error(trace, exc, end=False)  # the call's end ends the span
            call.end(Outcome.TIMEOUT if isinstance(exc, GatewayTimeout) else Outcome.ERROR)
            raise
        if turn is not None:
            await self._record(turn, text, final)
        body = reply_body(meta, text, final)
        return ReplyResponse(body, headers=rate)

    def _call(
        self, job: Job, request: SamplingRequest, ctx: ChatContext, trace: Trace | None
    ) -> ChatCall:
        return ChatCall(
            job,
            inbox=self._inbox,
            queue=self._queue,
            metrics=self._metrics,
            canceller=self._canceller,
            stream=request.stream,
            resumable=ctx.resumable,
            timeout_s=self._settings.request_timeout_s,
            clock=self._admitter.clock,
            user=request.user,
            trace=trace,
            client_request_id=ctx.client_request_id,
        )

    async def _serve_choices(
        self,
        request: SamplingRequest,
        job: Job,
        meta: RequestMeta,
        ctx: ChatContext,
        share: Share,
        headers: dict[str, str],
        trace: Trace | None,
    ) -> Response:
        """Serve ``n`` > 1 choices as ``n`` jobs, the first ``job`` itself (see
        :mod:`gateway.chat.choices`). A choice the queue refuses refuses the request, its
        queued siblings withdrawn."""
        jobs = [job] + [replace(job, id=f"{job.id}.{i}") for i in range(1, request.n)]
        # The request's span belongs to its first choice's call, which ends it.
        choices = Choices(
            [self._call(j, request, ctx, trace if i == 0 else None) for i, j in enumerate(jobs)]
        )
        try:
            for call in choices.calls:
                await call.enqueue(
                    meta,
                    self._settings.reply_log_ttl_s * 1000,
                    None,
                    self._settings.affinity_wait_ms,
                    share=share,
                    max_waiting=self._settings.max_queued,
                )
            keepalive_s = self._settings.sse_keepalive_s if request.stream else 0.0
            first = await choices.calls[0].first(ctx.receive, keepalive_s or None)
            if request.stream:
                formatters = [
                    ChunkFormatter(
                        meta.completion_id,
                        meta.model,
                        meta.created,
                        meta.include_usage,
                        continuous_usage=meta.continuous_usage,
                        kind=meta.kind,
                        index=i,
                        tools=meta.tools,
                        echo=meta.echo,
                        usage_last=False,
                    )
                    for i in range(request.n)
                ]
                return choices.stream(first, formatters, meta.include_usage, headers, keepalive_s)
            assert first is not None  # first() without patience always has the chunk
            replies = await choices.collect(first, ctx.receive)
        except ClientGone:
            choices.end(Outcome.CANCELLED)
            return Response(status_code=499)
        except BaseException as exc:
            if trace is not None:
                _trace_error(trace, exc, end=False)  # the first call's end ends the span
            choices.end(Outcome.TIMEOUT if isinstance(exc, GatewayTimeout) else Outcome.ERROR)
            raise
        body = whole_body(
            meta.kind,
            meta.completion_id,
            meta.model,
            meta.created,
            replies,
            meta.tools,
            meta.echo,
        )
        return ReplyResponse(body, headers=headers)

    async def _attach(
        self,
        request: SamplingRequest,
        ctx: ChatContext,
        enqueued: Enqueued,
        headers: dict[str, str],
    ) -> Response:
        """Serve the reply an earlier request with the same ``X-Request-Id`` started."""
        if enqueued.status != "attached":
            raise Conflict(
                f"X-Request-Id {ctx.client_request_id!r} was already used by this tenant for "
                "a different request; use a new id",
                param="X-Request-Id",
                code="request_id_reused",
            )
        readers, job_id = self._readers, enqueued.job_id
        timeout_s = self._settings.request_timeout_s
        limits = await self._limits(ctx.tenant)
        meta = await readers.begin(self._keys, job_id, ctx.tenant, limits.max_streams)
        if request.stream:
            keepalive_s = self._settings.sse_keepalive_s
            events = replay(readers.redis, self._keys, job_id, meta, 0, timeout_s, keepalive_s)
            return readers.response(ctx.tenant, events, {**SSE_HEADERS, **headers})
        try:
            text, final = await race_disconnect(
                collect(readers.redis, self._keys, job_id, timeout_s), ctx.receive
            )
        finally:
            readers.release(ctx.tenant)
        if final.error_code is not None:
            raise from_worker(final.error_code, final.error_message)
        body = reply_body(meta, text, final)
        return ReplyResponse(body, headers=headers)

    def check(self, request: SamplingRequest) -> None:
        """Reject what this server cannot do, with the field at fault."""
        self._admitter.check_model(request.model)
        if request.n > self._settings.max_choices:
            raise BadRequest(
                f"n is at most {self._settings.max_choices} on this server, got {request.n}",
                param="n",
                code="too_many_choices",
            )
        asked = getattr(request, "max_completion_tokens", None) or request.max_tokens
        bound = self._settings.max_completion_tokens
        if asked is not None and bound is not None and asked > bound:
            raise BadRequest(
                f"max_tokens is at most {bound} on this server, got {asked}",
                param="max_tokens",
                code="max_tokens_exceeded",
            )
        if request.seed is not None and not self._admitter.honours_seed:
            raise BadRequest(
                "seed is not supported by this cluster's replicas: vLLM's CPU engine fails "
                "a seeded request whose prefill is chunked; leave seed out, or use GPU "
                "replicas",
                param="seed",
                code="unsupported_field",
            )
        for key in request.logit_bias or {}:
            if not _TOKEN_ID.fullmatch(key):
                raise BadRequest(
                    f"logit_bias keys must be token ids, not {key!r}", param="logit_bias"
                )

    async def _build_prompt(
        self, request: ChatCompletionRequest, turn: PersonaTurn | None
    ) -> Prompt:
        """Render and tokenize the prompt; a long one off the event loop, which belongs to
        every request of this process."""
        messages = turn.messages if turn else template_messages(request.messages)
        options = turn.template if turn else None
        chars = prompt_chars(messages) + tools_chars(request.tools)
        if chars <= ON_LOOP_CHARS:
            return self._prompts.build(request, messages, options)
        return await asyncio.to_thread(self._prompts.build, request, messages, options)

    async def _limits(self, tenant: str) -> Limits:
        if self._auth is None:
            return self._settings.tenant_limits
        try:
            return await self._auth.limits(tenant)
        except RedisError as exc:
            raise queue_unavailable(exc) from exc

    def _within_limits(self, job: Job, limits: Limits, replies: int = 1) -> None:
        """What the tenant's limits allow this request: its class, its budget, and
        ``replies`` more open replies on this gateway."""
        cls = PriorityClass(job.priority_class)
        if cls not in limits.classes:
            raise PermissionDenied(
                f"this tenant may not use the {cls} class (it may use "
                f"{', '.join(limits.classes) or 'none'})",
                param="X-Priority",
                code="class_not_allowed",
            )
        floor = limits.budget_floor_ms.get(cls, 0)
        budget_ms = job.deadline_ms - job.arrival_ms
        if budget_ms < floor:
            raise BadRequest(
                f"X-Latency-Budget-Ms is at least {floor} ms in the {cls} class for this "
                f"tenant, not {budget_ms}",
                param="X-Latency-Budget-Ms",
                code="budget_below_floor",
            )
        open_now = self._inbox.open_for(job.tenant)
        if limits.max_streams and open_now + replies > limits.max_streams:
            self._metrics.rejected(cls, DropReason.TENANT_QUEUE_FULL)
            raise refused(
                DropReason.TENANT_QUEUE_FULL,
                f"this tenant has {limits.max_streams} replies open on this gateway, as many "
                "as its limits allow",
                1000,
            )

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
            raise queue_unavailable(exc) from exc

    async def _charge(self, tenant: str, tokens: int, priority: str) -> dict[str, str]:
        """Take the request from the tenant's rate limits; the x-ratelimit headers."""
        if self._auth is None:
            return {}
        try:
            decision = await self._auth.take(tenant, tokens)
        except RedisError as exc:
            raise queue_unavailable(exc) from exc
        except TooManyRequests:
            self._metrics.rejected(priority, DropReason.RATE_LIMITED)
            raise
        return decision.headers() if decision else {}

    async def _admit(self, job: Job, max_running: int = 0) -> None:
        try:
            await self._admitter.admit(job, max_running)
        except RedisError as exc:
            raise queue_unavailable(exc) from exc

    def _recorder(self, turn: PersonaTurn) -> OnComplete:
        async def record(text: str, final: Chunk) -> None:
            await self._record(turn, text, final)

        return record

    async def _record(self, turn: PersonaTurn, text: str, final: Chunk) -> None:
        """Append a completed persona turn to its session."""
        assert self._persona is not None
        try:
            await self._persona.completed(turn, text, final.worker_id)
        except RedisError as exc:
            log.warning("could not record the turn", session_id=turn.session_id, error=str(exc))


def _choices_allowed(ctx: ChatContext, turn: PersonaTurn | None) -> None:
    """Refuse what ``n`` > 1 cannot be combined with, naming the field."""
    if turn is not None:
        raise BadRequest(
            "n > 1 is not served for a session's turn, which keeps one reply: ask for "
            "alternatives with the session's swipe action",
            param="n",
            code="unsupported_field",
        )
    for header, asked in (
        ("X-Resumable", ctx.resumable),
        ("X-Event-Ids", ctx.event_ids),
        ("X-Request-Id", ctx.client_request_id is not None),
    ):
        if asked:
            raise BadRequest(
                f"{header} is not served with n > 1 (a reply of several choices cannot be "
                "resumed, numbered or attached to): ask for one choice, or leave the header out",
                param=header,
                code="unsupported_field",
            )


async def _traced(trace: Trace, work: Awaitable[Response]) -> Response:
    """Await ``work``, the request that ``trace`` spans; an error it raises before its call
    ended the span ends it, as the error the client gets."""
    try:
        return await work
    except BaseException as exc:
        _trace_error(trace, exc, end=True)
        raise


def _trace_error(trace: Trace, exc: BaseException, *, end: bool) -> None:
    """Record on the request's span (unless it ended) the error the client gets; with
    ``end``, end the span with it."""
    if not trace.recording:
        return
    if isinstance(exc, APIError):
        trace.set(
            {
                "http.response.status_code": exc.status,
                "error.type": exc.code or exc.type,
                "charserve.error": exc.message,
            }
        )
        message = exc.message
    elif isinstance(exc, Exception):
        trace.exception(exc)
        message = f"{type(exc).__name__}: {exc}"
    else:
        message = type(exc).__name__  # cancelled: the request was abandoned
    if end:
        trace.end(error=message)
