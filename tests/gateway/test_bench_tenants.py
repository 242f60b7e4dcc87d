"""``charserve bench-tenants`` against a keyed gateway: it makes its tenants, measures both,
and leaves no keys behind."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import pytest

from cluster.bench import tenants as bench
from cluster.runtime.redis_client import connect
from cluster.wire.keys import Keys
from cluster.wire.tenants import ApiKeys
from tests.fakes import FakeEngine
from tests.gateway.conftest import Gateway, gateway_settings, serve_gateway
from workers.loop.config import ConsumerConfig
from workers.loop.consumer import Consumer


@pytest.fixture
async def keyed(redis_url: str, model_path: str) -> AsyncIterator[tuple[str, str]]:
    settings = gateway_settings(redis_url, model_path, auth="keys", auth_cache_s=0)
    keys = Keys(settings.namespace)
    engine = FakeEngine(max_slots=4, delay_s=0.005)
    consumer = Consumer(redis_url, keys, engine, ConsumerConfig(heartbeat_ms=200))
    await consumer.start()
    try:
        async with serve_gateway(settings) as base_url:
            yield base_url, settings.namespace
    finally:
        await consumer.close()


def arguments(base_url: str, **overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--base-url", base_url])
    for name, value in {
        "max_tokens": 4,
        "calibrate_concurrency": 4,
        "calibrate_s": 0.5,
        "duration": 1.0,
        "rounds": 1,
        "flood_budget_ms": 300,
        **overrides,
    }.items():
        setattr(args, name, value)
    return args


async def test_the_flood_is_refused_and_the_chat_is_not(
    keyed: tuple[str, str], redis_url: str
) -> None:
    base_url, namespace = keyed
    result = await bench.bench_tenants(arguments(base_url), redis_url, namespace)
    report = result["report"]
    assert report["capacity_rps"] > 0
    flood = report["flood"]["flood"]
    # Ten times the capacity: much of it refused, quickly, with reasons.
    assert flood["requests"] > flood["served"] > 0
    assert flood["refused_at_admission"] + flood["expired_in_queue"] > 0
    assert set(flood["refusal_codes"]) <= {"budget", "expired", "tenant_queue_full", "queue_full"}
    assert report["alone"]["chat"]["requests"] > 0 and report["flood"]["chat"]["requests"] > 0
    assert report["summary"]["accepted_then_lost"] == 0
    assert report["flood"]["redis_used_memory_peak_mb"] > 0
    # The tenants it made are gone.
    redis = connect(redis_url)
    try:
        left = await ApiKeys(redis, Keys(namespace)).list()
    finally:
        await redis.aclose()
    assert not [r for r in left if r.tenant.startswith("bench-")]


async def test_an_open_gateway_is_refused(gateway: Gateway, redis_url: str) -> None:
    with pytest.raises(SystemExit, match="CHARSERVE_AUTH=keys"):
        await bench.bench_tenants(arguments(gateway.base_url), redis_url, "x")
