"""``POST /v1/chat/completions``, ``POST /v1/completions``, the resume route of their
streams, and ``/v1/models``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from gateway.chat.admission import classify
from gateway.chat.responses import (
    CHAT_COMPLETION_EXTRA,
    CHAT_COMPLETION_RESPONSES,
    CHAT_EVENTS_EXTRA,
    CHAT_EVENTS_RESPONSES,
    MODELS_RESPONSES,
    TEXT_COMPLETION_RESPONSES,
)
from gateway.chat.schemas import ChatCompletionRequest, CompletionRequest
from gateway.chat.service import ChatContext
from gateway.chat.tokenize import model_cards
from gateway.http.context import client_request_id, flag, request_id, tenant
from gateway.services import services
from gateway.streaming.resume import parse_last_event_id, replay
from gateway.streaming.socket_writer import RAW_SEND

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def chat_context(request: Request) -> ChatContext:
    """A completion request's admission and its connection's options (headers)."""
    s = services(request)
    admission = classify(
        s.settings,
        s.clock.now_ms(),
        request.headers.get("x-priority"),
        request.headers.get("x-latency-budget-ms"),
    )
    return ChatContext(
        request_id(request),
        tenant(request),
        admission,
        receive=request.receive,
        client_request_id=client_request_id(request),
        resumable=flag(request, "x-resumable"),
        event_ids=flag(request, "x-event-ids"),
        raw_send=request.scope.get(RAW_SEND),
    )


def router() -> APIRouter:
    """The chat routes."""
    api = APIRouter()

    @api.post(
        "/v1/chat/completions",
        response_model=None,
        responses=CHAT_COMPLETION_RESPONSES,
        openapi_extra=CHAT_COMPLETION_EXTRA,
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI Chat Completions, streaming (SSE) or not."""
        return await services(request).chat.complete(body, chat_context(request))

    @api.post(
        "/v1/completions",
        response_model=None,
        responses=TEXT_COMPLETION_RESPONSES,
        openapi_extra=CHAT_COMPLETION_EXTRA,
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI (legacy) Completions: a prompt continued as is, streaming or not."""
        return await services(request).chat.complete_text(body, chat_context(request))

    @api.get(
        "/v1/chat/completions/{completion_id}/events",
        response_model=None,
        response_class=StreamingResponse,
        responses=CHAT_EVENTS_RESPONSES,
        openapi_extra=CHAT_EVENTS_EXTRA,
    )
    async def chat_completion_events(completion_id: str, request: Request) -> Response:
        """Resume a streamed reply: the events after ``Last-Event-ID``, then live."""
        s = services(request)
        caller = tenant(request)
        job_id = completion_id.removeprefix("chatcmpl-").removeprefix("cmpl-")
        after = parse_last_event_id(request.headers.get("last-event-id"))
        limits = await s.auth.limits(caller)
        meta = await s.readers.begin(s.keys, job_id, caller, limits.max_streams)
        events = replay(
            s.readers.redis,
            s.keys,
            job_id,
            meta,
            after,
            s.settings.request_timeout_s,
            keepalive_s=s.settings.sse_keepalive_s,
        )
        return s.readers.response(caller, events, _SSE_HEADERS)

    @api.get("/v1/models", responses=MODELS_RESPONSES)
    async def models(request: Request) -> dict[str, Any]:
        """The served model and the LoRA adapters live replicas serve, as vLLM lists
        them (an adapter's ``parent`` is the base model)."""
        return {"object": "list", "data": model_cards(request)}

    return api
