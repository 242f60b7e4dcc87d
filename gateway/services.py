"""Everything one gateway process runs, built once at start-up and closed at shutdown.

The order matters: the inbox subscribes before anything can be enqueued (so no reply
arrives unrouted), the tokenizer loads off the event loop, and the batch runner starts
last, once the chat service it plays lines through exists.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog
from fastapi import Request

from cluster.runtime import gc_policy
from cluster.runtime.bundled_model import resolve_model
from cluster.runtime.clock import RedisClock
from cluster.runtime.redis_client import connect
from cluster.runtime.settings import Settings
from cluster.wire.keys import Keys
from cluster.wire.queue import JobQueue
from cluster.wire.tenants import ApiKeys, RateLimiter
from gateway.batches.runner import BatchRunner
from gateway.batches.store import BatchStore
from gateway.characters.memory import SessionMemory
from gateway.characters.persona_chat import PersonaChat
from gateway.characters.store import CharacterStore
from gateway.chat.admission import Admitter
from gateway.chat.capacity import CapacityView
from gateway.chat.prompts import PromptBuilder
from gateway.chat.service import ChatService
from gateway.http.auth import Authenticator, check_auth_mode
from gateway.metrics import GatewayMetrics, ProcessGroupMetrics
from gateway.streaming.relay import Inbox
from gateway.streaming.resume import Readers
from gateway.streaming.socket_writer import check_uvicorn

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Services:
    """The gateway's long-lived objects (``app.state.services``)."""

    settings: Settings
    keys: Keys
    gateway_id: str
    redis: aioredis.Redis
    inbox: Inbox
    capacity: CapacityView
    auth: Authenticator
    metrics: GatewayMetrics
    characters: CharacterStore
    chat: ChatService
    batch_store: BatchStore
    batch_runner: BatchRunner
    readers: Readers
    prompts: PromptBuilder
    # The page's share with sibling processes on one port (None with one process).
    metrics_group: ProcessGroupMetrics | None = None
    # Session summaries in flight (see gateway/characters/memory.py).
    memory: SessionMemory | None = None

    @property
    def clock(self) -> RedisClock:
        """Redis's time, as this process reads it (deadlines, freshness)."""
        return self.capacity.clock

    @classmethod
    async def start(cls, settings: Settings, keys: Keys) -> Services:
        """Connect, subscribe, load the tokenizer and start every background task."""
        if not settings.redis_url:
            raise RuntimeError("the gateway needs CHARSERVE_REDIS_URL")
        check_auth_mode(settings.auth, settings.host)
        if settings.auth == "open":
            log.warning(
                "auth is open: no API keys, every caller is the tenant 'default'",
                host=settings.host,
            )
        gateway_id = uuid.uuid4().hex[:12]
        redis = connect(settings.redis_url)
        inbox = Inbox(redis, keys, gateway_id, settings.relay_queue_chunks)
        await inbox.start()
        model_path = await asyncio.to_thread(resolve_model, settings.model)
        prompts = await asyncio.to_thread(
            PromptBuilder, model_path, settings.max_model_len, settings.default_max_tokens
        )
        queue = JobQueue(redis, keys, settings.queue_policy, settings.served_model_name)
        capacity = CapacityView(redis, keys, settings.heartbeat_ms)
        await capacity.start()
        auth = Authenticator(
            settings.auth,
            ApiKeys(redis, keys),
            RateLimiter(redis, keys),
            settings.tenant_limits,
            settings.auth_cache_s,
        )
        metrics = GatewayMetrics()
        metrics.bind(
            active_streams=lambda: inbox.active,
            queued=lambda: capacity.current.waiting,
            workers=lambda: capacity.current.workers,
        )
        metrics_group = await ProcessGroupMetrics.start_for(
            settings.gateway_workers, settings.port, metrics, redis, keys, gateway_id
        )
        characters = CharacterStore(
            redis, keys, settings.session_ttl_s, settings.max_session_messages
        )
        persona = PersonaChat(
            characters,
            prompts.count,
            settings.max_model_len,
            settings.default_system_prompt,
            settings.session_affinity,
            settings.prompt_layout,
            settings.served_model_name,
            lambda: capacity.current.adapters,
        )
        # Readers of reply logs block on their own connections, never the chat path's.
        readers = Readers(
            connect(settings.redis_url, blocking=True, max_connections=settings.max_resume_readers),
            settings.max_resume_readers,
            redis,
        )
        admitter = Admitter(settings, queue, capacity, metrics)
        chat = ChatService(
            settings, queue, inbox, prompts, admitter, auth, metrics, persona, readers=readers
        )
        memory = SessionMemory(characters, chat, prompts, settings, capacity.clock)
        persona.memory = memory
        batch_store = BatchStore(redis, keys, settings.file_ttl_s)
        batch_runner = BatchRunner(batch_store, chat, queue, settings, capacity.clock)
        await batch_runner.start()
        # Everything built so far (the tokenizer, transformers, the app) lives as long as
        # the process: out of the collector's sight, and collections spaced out.
        gc_policy.settle()
        unavailable = check_uvicorn()
        if unavailable is not None:
            log.warning("tokens take the ASGI path: no direct socket writes", reason=unavailable)
        log.info("gateway started", gateway_id=gateway_id, inbox=inbox.channel)
        return cls(
            settings,
            keys,
            gateway_id,
            redis,
            inbox,
            capacity,
            auth,
            metrics,
            characters,
            chat,
            batch_store,
            batch_runner,
            readers,
            prompts,
            metrics_group,
            memory,
        )

    async def close(self) -> None:
        """Stop every background task, newest first, then close Redis."""
        await self.batch_runner.close()
        if self.memory is not None:
            await self.memory.close()
        if self.metrics_group is not None:
            await self.metrics_group.close()
        await self.capacity.close()
        await self.inbox.close()
        await self.readers.redis.aclose()
        await self.redis.aclose()


def services(request: Request) -> Services:
    """The services of the app serving ``request``."""
    return request.app.state.services  # type: ignore[no-any-return]
