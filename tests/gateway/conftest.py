"""A gateway served by real uvicorn on 127.0.0.1, a real Redis, and a consumer driving the
deterministic test engine: the whole control plane without a model."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from cluster.keys import Keys
from cluster.redis import free_port
from cluster.settings import Settings
from gateway.app import create_app
from tests.fakes import FakeEngine
from workers.consumer import Consumer, ConsumerConfig


@dataclass
class Gateway:
    """A running gateway and what is behind it."""

    base_url: str
    engine: FakeEngine
    keys: Keys
    settings: Settings


@pytest.fixture(scope="module")
async def gateway(redis_url: str, model_path: str) -> AsyncIterator[Gateway]:
    keys = Keys(f"gw{uuid.uuid4().hex[:8]}")
    port = free_port()
    settings = Settings(
        redis_url=redis_url,
        namespace=keys.namespace,
        model=model_path,
        port=port,
        max_model_len=512,
        heartbeat_ms=200,
        log_format="console",
    )
    engine = FakeEngine(max_slots=8, delay_s=0.002)
    consumer = Consumer(redis_url, keys, engine, ConsumerConfig(heartbeat_ms=200))
    await consumer.start()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings),
            host="127.0.0.1",
            port=port,
            log_config=None,
            lifespan="on",
            access_log=False,
        )
    )
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(60):
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.05)
    yield Gateway(f"http://127.0.0.1:{port}", engine, keys, settings)
    server.should_exit = True
    await task
    engine.release.set()
    await consumer.close()


@pytest.fixture
async def http(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as client:
        yield client
