"""Shared fixtures: one real ``redis-server`` per test session, fresh namespaces per test,
and the bundled model folder (prepared by ``make``)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from cluster.runtime.bundled_model import resolve_model
from cluster.runtime.redis_client import connect
from cluster.runtime.redis_server import RedisServer
from cluster.wire.keys import Keys


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A private redis-server on 127.0.0.1 for the whole session."""
    with RedisServer() as server:
        yield server.url


@pytest.fixture
def keys() -> Keys:
    """A namespace no other test uses."""
    return Keys(f"t{uuid.uuid4().hex[:10]}")


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """An asyncio client on the session's Redis."""
    client = connect(redis_url)
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def model_path() -> str:
    """The bundled model's Hugging Face folder."""
    return resolve_model(None)
