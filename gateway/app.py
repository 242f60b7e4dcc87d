"""The gateway application: routes, error handlers, request ids, and its lifespan.

``create_app()`` is a factory (uvicorn ``--factory``) so settings are read in the serving
process, never at import time. The lifespan connects to Redis, subscribes the inbox (before
the first request can be enqueued) and loads the tokenizer.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from cluster.runtime import gc_policy as heap
from cluster.runtime.bundled_model import resolve_model
from cluster.runtime.clock import now_ms
from cluster.runtime.logs import configure_logging
from cluster.runtime.prometheus import CONTENT_TYPE as METRICS_CONTENT_TYPE
from cluster.runtime.prometheus import read_worker_metrics, render_all
from cluster.runtime.redis_client import connect
from cluster.runtime.settings import Settings
from cluster.wire.keys import Keys
from cluster.wire.queue import JobQueue
from cluster.wire.tenants import ApiKeys, Limits, RateLimiter
from gateway.batches.routes import install as install_batches
from gateway.characters.store import CharacterStore, PersonaChat
from gateway.characters.store import router as characters_router
from gateway.chat.admission import Admitter, admit
from gateway.chat.capacity import CapacityView
from gateway.chat.prompts import PromptBuilder
from gateway.chat.schemas import (
    CHAT_COMPLETION_EXTRA,
    CHAT_COMPLETION_RESPONSES,
    CHAT_EVENTS_EXTRA,
    CHAT_EVENTS_RESPONSES,
    HEALTH_RESPONSES,
    MODELS_RESPONSES,
    READY_RESPONSES,
    ChatCompletionRequest,
)
from gateway.chat.service import ChatService
from gateway.http.errors import APIError, BadRequest, error_response
from gateway.http.middleware import Authenticator, EdgeMiddleware, new_request_id
from gateway.http.openapi import document_errors
from gateway.metrics import GatewayMetrics
from gateway.streaming.relay import Inbox
from gateway.streaming.resume import load_meta, parse_last_event_id, replay
from gateway.streaming.socket_writer import RAW_SEND

log = structlog.get_logger(__name__)


def _tenant(request: Request) -> str:
    """The caller's tenant, set by the edge middleware from the API key."""
    return str(request.state.tenant)


def _flag(request: Request, header: str) -> bool:
    """A ``true``/``false`` request header (absent: false)."""
    value = request.headers.get(header)
    if value is None:
        return False
    flag = value.strip().lower()
    if flag not in ("true", "false"):
        raise BadRequest(f"{header} must be true or false, not {value[:40]!r}", param=header)
    return flag == "true"


def _request_id(request: Request) -> str:
    return str(getattr(request.state, "request_id", "") or new_request_id())


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return BadRequest(
            f"the body is not valid JSON: {first.get('msg', '')}", code="invalid_json"
        )
    if not loc and kind in ("model_attributes_type", "dict_type", "missing"):
        return BadRequest("the body must be a JSON object", code="invalid_json")
    param = ".".join(loc) or (first.get("ctx") or {}).get("param") or None
    message = first.get("msg", "invalid request")
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problems)"
    return BadRequest(message, param=param, code="invalid_value")


class GatewayApp(FastAPI):
    """FastAPI that keeps the server's own ``send`` in the scope (:data:`RAW_SEND`): the
    chat route's streams write tokens through it (see :mod:`gateway.streaming.socket_writer`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        await super().__call__(scope, receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the gateway app; settings default to the environment."""
    settings = settings or Settings()
    configure_logging(settings.log_level, settings.log_format)
    keys = Keys(settings.namespace)
    gateway_id = uuid.uuid4().hex[:12]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not settings.redis_url:
            raise RuntimeError("the gateway needs CHARSERVE_REDIS_URL")
        redis = connect(settings.redis_url)
        inbox = Inbox(redis, keys, gateway_id, settings.relay_queue_chunks)
        await inbox.start()
        model_path = await asyncio.to_thread(resolve_model, settings.model)
        prompts = await asyncio.to_thread(
            PromptBuilder, model_path, settings.max_model_len, settings.default_max_tokens
        )
        queue = JobQueue(redis, keys, settings.queue_policy)
        capacity = CapacityView(redis, keys, settings.heartbeat_ms)
        await capacity.start()
        auth = Authenticator(
            ApiKeys(redis, keys),
            RateLimiter(redis, keys),
            Limits(settings.rate_limit_rpm, settings.rate_limit_tpm),
            settings.auth_cache_s,
        )
        metrics = GatewayMetrics()
        metrics.bind(
            active_streams=lambda: inbox.active,
            queued=lambda: capacity.current.waiting,
            workers=lambda: capacity.current.workers,
        )
        app.state.redis = redis
        app.state.inbox = inbox
        app.state.auth = auth
        app.state.metrics = metrics
        app.state.characters = characters = CharacterStore(redis, keys)
        persona = PersonaChat(
            characters,
            prompts.count,
            settings.max_model_len,
            settings.default_system_prompt,
            settings.session_affinity,
        )
        app.state.chat = ChatService(
            settings,
            queue,
            inbox,
            prompts,
            Admitter(settings, queue, capacity, metrics),
            auth,
            metrics,
            persona,
        )
        # Everything built so far (the tokenizer, transformers, the app) lives as long as
        # the process: out of the collector's sight, and collections spaced out.
        heap.settle()
        log.info("gateway started", gateway_id=gateway_id, inbox=inbox.channel)
        try:
            yield
        finally:
            await capacity.close()
            await inbox.close()
            await redis.aclose()

    app = GatewayApp(title="charserve", version="0.1.0", lifespan=lifespan)
    app.include_router(characters_router())
    install_batches(app, settings, keys)  # the Batch API routes and the batch runner
    app.add_middleware(EdgeMiddleware, max_body_bytes=settings.max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, _request_id(request))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc), _request_id(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        if code is None and exc.status_code < 500:
            code = "invalid_request"  # e.g. a body FastAPI cannot parse, a bad multipart form
        # exc.headers: e.g. the Allow header a 405 must carry.
        error = APIError(str(exc.detail), code=code, headers=dict(exc.headers or {}))
        error.status = exc.status_code
        error.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(error, _request_id(request))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", request_id=_request_id(request))
        return error_response(APIError("internal error"), _request_id(request))

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses=CHAT_COMPLETION_RESPONSES,
        openapi_extra=CHAT_COMPLETION_EXTRA,
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI Chat Completions, streaming (SSE) or not."""
        request_id = _request_id(request)
        admission = admit(
            settings,
            now_ms(),
            request.headers.get("x-priority"),
            request.headers.get("x-latency-budget-ms"),
        )
        chat: ChatService = request.app.state.chat
        resumable = _flag(request, "x-resumable")
        return await chat.complete(
            body,
            request_id,
            admission,
            _tenant(request),
            request.receive,
            resumable,
            request.scope.get(RAW_SEND),
            event_ids=_flag(request, "x-event-ids"),
        )

    @app.get(
        "/v1/chat/completions/{completion_id}/events",
        response_model=None,
        response_class=StreamingResponse,
        responses=CHAT_EVENTS_RESPONSES,
        openapi_extra=CHAT_EVENTS_EXTRA,
    )
    async def chat_completion_events(completion_id: str, request: Request) -> Response:
        """Resume a streamed reply: the events after ``Last-Event-ID``, then live."""
        request_id = completion_id.removeprefix("chatcmpl-")
        after = parse_last_event_id(request.headers.get("last-event-id"))
        redis = request.app.state.redis
        meta = await load_meta(redis, keys, request_id, _tenant(request))
        return StreamingResponse(
            replay(redis, keys, request_id, meta, after, settings.request_timeout_s),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.get("/v1/models", responses=MODELS_RESPONSES)
    async def models() -> dict[str, Any]:
        """The served model, as OpenAI lists models."""
        return {
            "object": "list",
            "data": [
                {
                    "id": settings.served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "charserve",
                    "max_model_len": settings.max_model_len,
                }
            ],
        }

    @app.get("/metrics", include_in_schema=False)
    async def metrics_page(request: Request) -> Response:
        """Prometheus metrics: this gateway's, plus every live worker's (and its vLLM
        engine's) as the workers last exported them, labelled by ``replica``."""
        try:
            texts = await read_worker_metrics(request.app.state.redis, keys)
        except RedisError:
            texts = {}
        body = await asyncio.to_thread(render_all, request.app.state.metrics.registry, texts)
        return Response(body, media_type=METRICS_CONTENT_TYPE)

    @app.get("/health", responses=HEALTH_RESPONSES)
    async def health() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/ready", responses=READY_RESPONSES)
    async def ready(request: Request) -> JSONResponse:
        """Readiness: Redis answers, the inbox is subscribed, and a worker is claiming."""
        redis = request.app.state.redis
        inbox: Inbox = request.app.state.inbox
        fresh_ms = now_ms() - 3 * settings.heartbeat_ms
        try:
            workers = await redis.zcount(keys.workers, fresh_ms, "+inf")
        except RedisError:
            return JSONResponse({"status": "unavailable", "reason": "redis"}, status_code=503)
        if not inbox.subscribed.is_set():
            return JSONResponse({"status": "unavailable", "reason": "inbox"}, status_code=503)
        if workers == 0:
            return JSONResponse({"status": "unavailable", "reason": "no_workers"}, status_code=503)
        return JSONResponse({"status": "ready", "workers": workers})

    document_errors(app)
    return app
