"""A gateway served by real uvicorn on 127.0.0.1, a real Redis, and a consumer driving the
deterministic test engine: the whole control plane without a model."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from cluster.runtime.net import free_port
from cluster.runtime.settings import Settings
from cluster.wire.keys import Keys
from gateway.app import create_app
from gateway.http.server import PROTOCOL
from tests.fakes import FakeEngine
from workers.loop.config import ConsumerConfig
from workers.loop.consumer import Consumer


@dataclass
class Gateway:
    """A running gateway and what is behind it."""

    base_url: str
    engine: FakeEngine
    keys: Keys
    settings: Settings


@asynccontextmanager
async def serve_gateway(settings: Settings, app: FastAPI | None = None) -> AsyncIterator[str]:
    """Serve ``app`` (default: the gateway app for ``settings``) with real uvicorn on
    ``settings.port``; yield its base URL."""
    server = uvicorn.Server(
        uvicorn.Config(
            app or create_app(settings),
            host="127.0.0.1",
            port=settings.port,
            log_config=None,
            lifespan="on",
            access_log=False,
            # What charserve gateway runs: httptools with a header-read timeout.
            http=PROTOCOL,
        )
    )
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(60):
        while not server.started:  # uvicorn offers no event for this
            if task.done():
                task.result()
            await asyncio.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{settings.port}"
    finally:
        server.should_exit = True
        await task


def gateway_settings(redis_url: str, model_path: str, **overrides: object) -> Settings:
    """Settings for a test gateway in a fresh namespace on a free port."""
    values: dict[str, object] = {
        "redis_url": redis_url,
        "namespace": f"gw{uuid.uuid4().hex[:8]}",
        "model": model_path,
        "port": free_port(),
        "max_model_len": 512,
        "heartbeat_ms": 1000,  # alive for 3 s: a loaded machine may delay a beat
        "log_format": "console",
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
async def gateway(redis_url: str, model_path: str) -> AsyncIterator[Gateway]:
    settings = gateway_settings(redis_url, model_path)
    keys = Keys(settings.namespace)
    engine = FakeEngine(max_slots=8, delay_s=0.002)
    consumer = Consumer(
        redis_url, keys, engine, ConsumerConfig(heartbeat_ms=200, batch_reserve_slots=0)
    )
    await consumer.start()
    async with serve_gateway(settings) as base_url:
        yield Gateway(base_url, engine, keys, settings)
    engine.release.set()
    await consumer.close()


@pytest.fixture
async def http(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as client:
        yield client
