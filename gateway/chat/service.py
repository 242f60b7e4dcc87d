"""``POST /v1/chat/completions`` up to the enqueue, then the reply.

The flow of one request, top to bottom in :meth:`ChatService.complete`: the model and
options are checked and the prompt rendered (any problem is a 4xx before anything is
queued); the tenant's rate limits are charged; the job is admitted against its latency
budget; then a :class:`~gateway.chat.call.ChatCall` takes the request over: it registers
the reply stream, enqueues the job, waits for the first chunk while watching for a client
that leaves, and streams the reply as SSE or collects it into one JSON body. A client that
goes away at any point cancels the job: dequeued if it waits, aborted in the engine if it
runs.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import structlog
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError
from starlette.types import Send

from cluster.runtime.settings import Settings
from cluster.wire.protocol import Chunk, Job
from cluster.wire.queue import JobQueue
from cluster.wire.vocabulary import DropReason, Outcome
from gateway.characters.persona_chat import PersonaChat, PersonaTurn
from gateway.chat.admission import Admission, Admitter
from gateway.chat.call import (
    Canceller,
    ChatCall,
    ClientGone,
    OnComplete,
    Receive,
    queue_unavailable,
)
from gateway.chat.prompts import PromptBuilder
from gateway.chat.schemas import ChatCompletionRequest
from gateway.http.auth import Authenticator
from gateway.http.errors import BadRequest, GatewayTimeout, NotFound, TooManyRequests
from gateway.metrics import GatewayMetrics
from gateway.streaming.relay import Inbox
from gateway.streaming.resume import RequestMeta
from gateway.streaming.sse import ChunkFormatter, completion_body

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
    to the connection (see :mod:`gateway.streaming.socket_writer`).
    """

    request_id: str
    tenant: str
    admission: Admission
    receive: Receive = never_disconnects
    resumable: bool = False
    event_ids: bool = False
    raw_send: Send | None = None


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
        self._canceller = Canceller(queue)

    async def complete(self, request: ChatCompletionRequest, ctx: ChatContext) -> Response:
        """Run one chat completion end to end: an SSE response, or one JSON body."""
        self.check(request)
        turn = await self._persona_turn(request, ctx.tenant)
        prompt = self._prompts.build(request, turn.messages if turn else None)
        rate = await self._charge(
            ctx.tenant, len(prompt.token_ids) + prompt.max_tokens, ctx.admission.priority_class
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
        )
        await self._admit(job)
        meta = RequestMeta(
            ctx.tenant,
            f"chatcmpl-{job.id}",
            request.model,
            int(time.time()),
            request.include_usage,
        )
        call = ChatCall(
            job,
            inbox=self._inbox,
            queue=self._queue,
            metrics=self._metrics,
            canceller=self._canceller,
            stream=request.stream,
            resumable=ctx.resumable,
            timeout_s=self._settings.request_timeout_s,
        )
        try:
            await call.enqueue(
                meta,
                self._settings.reply_log_ttl_s * 1000,
                turn.prefer if turn else None,
                self._settings.affinity_wait_ms,
            )
            first = await call.first(ctx.receive)
            if request.stream:
                fmt = ChunkFormatter(
                    meta.completion_id,
                    meta.model,
                    meta.created,
                    meta.include_usage,
                    event_ids=ctx.resumable or ctx.event_ids,
                )
                on_complete = self._recorder(turn) if turn else None
                return call.stream(first, fmt, ctx.raw_send, on_complete, rate)
            text, final = await call.collect(first, ctx.receive)
        except ClientGone:
            call.end(Outcome.CANCELLED)
            return Response(status_code=499)
        except BaseException as exc:
            call.end(Outcome.TIMEOUT if isinstance(exc, GatewayTimeout) else Outcome.ERROR)
            raise
        if turn is not None:
            await self._record(turn, text, final)
        body = completion_body(meta.completion_id, meta.model, meta.created, text, final)
        return JSONResponse(body, headers=rate)

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
            raise queue_unavailable() from exc

    async def _charge(self, tenant: str, tokens: int, priority: str) -> dict[str, str]:
        """Take the request from the tenant's rate limits; the x-ratelimit headers."""
        if self._auth is None:
            return {}
        try:
            decision = await self._auth.take(tenant, tokens)
        except RedisError as exc:
            raise queue_unavailable() from exc
        except TooManyRequests:
            self._metrics.rejected(priority, DropReason.RATE_LIMITED)
            raise
        return decision.headers() if decision else {}

    async def _admit(self, job: Job) -> None:
        try:
            await self._admitter.admit(job)
        except RedisError as exc:
            raise queue_unavailable() from exc

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
