"""A replica killed with SIGKILL mid-stream on a real Ray Serve deployment: every request
ends in a terminal state, and streams that already started finish seamlessly on the other
replica. Two replicas of the simulated engine stand in for GPUs (two vLLM engines would
fight over this machine's two cores); the queue, leases, relay and gateway are the real
ones."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from cluster.ops.ray_serve import deploy
from cluster.wire.keys import Keys
from cluster.wire.replylog import read_reply_log
from gateway.chat.prompts import PromptBuilder
from gateway.chat.schemas import ChatCompletionRequest
from tests.gateway.conftest import gateway_settings, serve_gateway
from tests.polling import eventually
from workers.engines.simulated import simulated_text, simulated_token

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    import ray
    from ray import serve

    ray.init(
        include_dashboard=False,
        num_cpus=2,
        logging_level=logging.WARNING,
        _node_ip_address="127.0.0.1",
    )
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
async def cluster(
    ray_cluster: None, redis_url: str, model_path: str
) -> AsyncIterator[tuple[str, Keys]]:
    settings = gateway_settings(redis_url, model_path, heartbeat_ms=300, max_model_len=2048)
    keys = Keys(settings.namespace)
    config: dict[str, Any] = {
        "proxy_location": "Disabled",
        "applications": [
            {
                "name": "failover",
                "import_path": "workers.deployment:build_app",
                "route_prefix": None,
                "args": {
                    "redis_url": redis_url,
                    "namespace": keys.namespace,
                    "engine_kind": "simulated",
                    "simulated": {"max_num_seqs": 4, "step_base_ms": 25, "step_ms_per_seq": 1},
                    "lease_ms": 1500,
                    "heartbeat_ms": 300,
                    "batch_reserve_slots": 0,
                    "log_format": "console",
                },
                "deployments": [
                    {
                        "name": "CharserveWorker",
                        "num_replicas": 2,
                        "ray_actor_options": {"num_cpus": 0.5},
                    }
                ],
            }
        ],
    }
    await asyncio.to_thread(deploy, config, 300)
    async with serve_gateway(settings) as base_url:
        yield base_url, keys


def expected_text(prompts: PromptBuilder, content: str) -> str:
    request = ChatCompletionRequest.model_validate(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS,
        }
    )
    ids = prompts.build(request).token_ids
    return "".join(simulated_text(simulated_token(ids, i)) for i in range(MAX_TOKENS))


async def stream(
    http: httpx.AsyncClient, content: str, started: asyncio.Event
) -> tuple[str, str, str]:
    body = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "messages": [{"role": "user", "content": content}],
    }
    parts: list[str] = []
    finish = ""
    # Standard class (30 s budget): the queued ones must wait longer than an interactive
    # budget allows, and this test wants every request to finish.
    headers = {"X-Priority": "standard"}
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status_code == 200, await resp.aread()
        request_id = resp.headers["x-request-id"]
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            choice = event["choices"][0]
            parts.append(choice["delta"].get("content") or "")
            finish = choice["finish_reason"] or finish
            if len(parts) >= 5:
                started.set()
    return request_id, "".join(parts), finish


async def test_sigkill_of_a_replica_loses_no_request(
    cluster: tuple[str, Keys], redis_url: str, model_path: str
) -> None:
    base_url, keys = cluster
    prompts = PromptBuilder(model_path, 2048, 256)
    redis = aioredis.Redis.from_url(redis_url)
    contents = [f"Tell me tale number {n}." for n in range(12)]  # 8 slots: 4 wait in the queue
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        first_started = asyncio.Event()
        events = [first_started] + [asyncio.Event() for _ in contents[1:]]
        tasks = [
            asyncio.create_task(stream(http, c, e)) for c, e in zip(contents, events, strict=True)
        ]
        await asyncio.wait_for(first_started.wait(), 60)

        # Find the replica serving the first stream, from its reply log, and kill it hard.
        async def has_chunk() -> bool:
            for request_id in await _request_ids(redis, keys):
                if await read_reply_log(redis, keys, request_id):
                    return True
            return False

        await eventually(has_chunk, timeout_s=10)
        victim = await _a_busy_worker_pid(redis, keys)
        os.kill(victim, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    for content, (request_id, text, finish) in zip(contents, results, strict=True):
        assert finish == "length", request_id
        assert text == expected_text(prompts, content), request_id  # seamless: nothing twice
    pids: set[str] = set()
    for request_id, _, _ in results:
        pids |= {
            c.worker_id.rsplit("-", 2)[1] for c in await read_reply_log(redis, keys, request_id)
        }
    assert str(victim) in pids and len(pids) >= 2  # the victim served, another took over
    await redis.aclose()


async def _request_ids(redis: aioredis.Redis, keys: Keys) -> list[str]:
    return [k.decode().rsplit(":", 1)[1] async for k in redis.scan_iter(match=keys.reply_log("*"))]


async def _a_busy_worker_pid(redis: aioredis.Redis, keys: Keys) -> int:
    for request_id in await _request_ids(redis, keys):
        chunks = await read_reply_log(redis, keys, request_id)
        if chunks and not chunks[-1].is_final:
            return int(chunks[-1].worker_id.rsplit("-", 2)[1])
    raise AssertionError("no stream in flight")
