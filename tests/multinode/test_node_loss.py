"""A whole Ray node fails under load: every request still reaches a terminal state, the
streams it was running continue seamlessly on the other node, and the queued requests
complete there.

Two replicas, one per node (``max_replicas_per_node: 1``), four batch slots each, twelve
streams: eight run, four wait in the queue. Once the second node's replica is streaming,
every process of that node is killed at once (raylet, workers, the replica), as when a
machine drops off the network. Its leases expire and the first node's replica takes the
jobs over. The gateway is ``charserve gateway`` with two processes, as an operator runs it
beside a cluster against the shared Redis. (This runs after the autoscaling test: the
package's cluster loses a node here.)
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
import redis.asyncio as aioredis

from cluster.wire.keys import Keys
from cluster.wire.replylog import read_reply_log
from gateway.chat.prompts import PromptBuilder
from tests.multinode.conftest import (
    charserve_deploy,
    chat,
    expected_text,
    gateway_processes,
    live_workers,
    simulated_app,
    worker_pid,
)
from tests.multinode.raycluster import LocalRayCluster
from tests.polling import eventually

pytestmark = pytest.mark.e2e

MAX_TOKENS = 120


async def test_losing_a_node_leaves_every_request_terminal(
    ray_cluster: LocalRayCluster, redis_url: str, model_path: str
) -> None:
    keys = Keys(f"mn{uuid.uuid4().hex[:8]}")
    config = simulated_app(
        {
            "simulated": {"max_num_seqs": 4, "step_base_ms": 25, "step_ms_per_seq": 1},
            "lease_ms": 1500,
            "heartbeat_ms": 300,
            "batch_reserve_slots": 0,
        },
        {"num_replicas": 2, "max_replicas_per_node": 1, "ray_actor_options": {"num_cpus": 0.5}},
    )
    await charserve_deploy(ray_cluster, config, redis_url, keys)
    redis = aioredis.Redis.from_url(redis_url)

    # One replica on each node.
    async def two_workers() -> bool:
        return len(await live_workers(redis, keys)) == 2

    await eventually(two_workers, timeout_s=30)
    nodes = {
        ray_cluster.node_of(worker_pid(w.worker_id)): w.worker_id
        for w in await live_workers(redis, keys)
    }
    assert set(nodes) == {"node_a", "node_b"}, nodes
    survivor, victim = nodes["node_a"], nodes["node_b"]

    prompts = PromptBuilder(model_path, 2048, 256)
    contents = [f"Tell me tale number {n}." for n in range(12)]
    async with (
        gateway_processes(redis_url, keys, model_path) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=120) as http,
    ):
        # Standard class: the queued ones wait longer than an interactive budget allows.
        headers = {"X-Priority": "standard"}
        tasks = [asyncio.create_task(chat(http, c, MAX_TOKENS, headers)) for c in contents]

        async def victim_streaming() -> bool:
            for request_id in await _logged_requests(redis, keys):
                chunks = await read_reply_log(redis, keys, request_id)
                if len(chunks) >= 5 and chunks[-1].worker_id == victim:
                    return True
            return False

        await eventually(victim_streaming, timeout_s=30)
        started_before_loss = set(await _logged_requests(redis, keys))
        on_victim = set()
        for request_id in started_before_loss:
            chunks = await read_reply_log(redis, keys, request_id)
            if chunks and chunks[-1].worker_id == victim and not chunks[-1].is_final:
                on_victim.add(request_id)
        assert len(started_before_loss) < len(contents)  # some still wait in the queue
        await asyncio.to_thread(ray_cluster.second.kill)
        replies = await asyncio.wait_for(asyncio.gather(*tasks), 120)

    # Every request reached a terminal state, and here that state is "completed": the
    # streams on the lost node continued on the other, nothing twice, nothing missing.
    for content, reply in zip(contents, replies, strict=True):
        assert reply.error is None, (reply.request_id, reply.error)
        assert reply.finish_reason == "length", reply.request_id
        assert reply.text == expected_text(prompts, content, MAX_TOKENS), reply.request_id
    served_by: dict[str, set[str]] = {}
    for reply in replies:
        chunks = await read_reply_log(redis, keys, reply.request_id)
        served_by[reply.request_id] = {c.worker_id for c in chunks}
    # What the victim was streaming when its node died was finished by the survivor.
    assert on_victim and all(served_by[r] == {victim, survivor} for r in on_victim)
    # The requests still queued when the node died completed on the first node.
    queued = set(served_by) - started_before_loss
    assert queued and all(served_by[r] == {survivor} for r in queued)
    # Nothing is left behind in the queue.
    assert await redis.zcard(keys.queue) == 0
    assert await redis.zcard(keys.leases) == 0
    await redis.aclose()


async def _logged_requests(redis: aioredis.Redis, keys: Keys) -> list[str]:
    return [k.decode().rsplit(":", 1)[1] async for k in redis.scan_iter(match=keys.reply_log("*"))]
