"""Multi-node tests: a real two-node Ray cluster (``ray start --head`` plus ``ray start
--address``), the simulated engine deployed onto it with ``charserve deploy``, the real
gateway in front, and the session's Redis. Two vLLM engines would fight over this
machine's two cores, so the simulated engine stands in for the model; everything else
(queue, leases, drain, autoscaling policy, Serve, Ray) is the real thing."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
import yaml

from cluster.runtime.net import free_port, wait_ready
from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import WorkerStats
from gateway.chat.prompts import PromptBuilder
from gateway.chat.schemas import ChatCompletionRequest
from tests.multinode.raycluster import LocalRayCluster
from workers.engines.simulated import simulated_text, simulated_token

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[LocalRayCluster]:
    """Both nodes, for every test of the package (the node-loss test runs last)."""
    cluster = LocalRayCluster(num_cpus=2)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def simulated_app(args: dict[str, Any], deployment: dict[str, Any]) -> dict[str, Any]:
    """A Serve config of the simulated engine with these args and deployment options."""
    return {
        "proxy_location": "Disabled",
        "applications": [
            {
                "name": "charserve",
                "import_path": "workers.deployment:build_app",
                "route_prefix": None,
                "args": {"engine_kind": "simulated", "log_format": "console", **args},
                "deployments": [{"name": "CharserveWorker", **deployment}],
            }
        ],
    }


async def charserve_deploy(
    cluster: LocalRayCluster, config: dict[str, Any], redis_url: str, keys: Keys
) -> str:
    """Run ``charserve deploy`` against the cluster, as an operator would."""
    path = Path(cluster.head.temp_dir, f"serve-{time.monotonic_ns()}.yaml")
    await asyncio.to_thread(path.write_text, yaml.safe_dump(config))
    env = {
        **cluster.env,
        "RAY_ADDRESS": cluster.address,
        "CHARSERVE_REDIS_URL": redis_url,
        "CHARSERVE_NAMESPACE": keys.namespace,
        "CHARSERVE_LOG_FORMAT": "console",
    }
    command = [sys.executable, "-m", "cluster.ops.cli", "deploy", "--config", str(path)]
    done = await asyncio.to_thread(
        subprocess.run, [*command, "--timeout-s", "120"], env=env, capture_output=True, timeout=180
    )
    output = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode == 0, (
        f"{output}\n=== head ===\n{cluster.head.logs()}\n=== second ===\n{cluster.second.logs()}"
    )
    return output


@asynccontextmanager
async def gateway_processes(
    redis_url: str, keys: Keys, model_path: str, processes: int = 2
) -> AsyncIterator[str]:
    """``charserve gateway`` (``processes`` uvicorn workers) against the shared Redis, as
    an operator runs it beside a cluster; yields its base URL."""
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CHARSERVE_")},
        "CHARSERVE_REDIS_URL": redis_url,
        "CHARSERVE_NAMESPACE": keys.namespace,
        "CHARSERVE_MODEL": model_path,
        "CHARSERVE_PORT": str(port),
        "CHARSERVE_GATEWAY_WORKERS": str(processes),
        "CHARSERVE_HEARTBEAT_MS": "300",
        "CHARSERVE_MAX_MODEL_LEN": "2048",
        "CHARSERVE_LOG_FORMAT": "console",
    }
    command = [sys.executable, "-m", "cluster.ops.cli", "gateway"]
    proc = await asyncio.to_thread(subprocess.Popen, command, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(wait_ready, f"{base_url}/ready", proc, 120)
        yield base_url
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)


async def live_workers(redis: aioredis.Redis, keys: Keys) -> list[WorkerStats]:
    """Workers with a fresh heartbeat that are not draining."""
    ids = await redis.zrange(keys.workers, 0, -1)
    stats = [await redis.get(keys.worker_stats(i.decode())) for i in ids]
    decoded = [protocol.decode_as(s, WorkerStats) for s in stats if s]
    return [s for s in decoded if not s.draining]


def worker_pid(worker_id: str) -> int:
    """The pid in a worker id (``host-pid-suffix``)."""
    return int(worker_id.rsplit("-", 2)[1])


@dataclass
class Reply:
    """How one streamed request ended."""

    request_id: str
    text: str
    finish_reason: str
    error: dict[str, Any] | None


async def chat(
    http: httpx.AsyncClient,
    content: str,
    max_tokens: int,
    headers: dict[str, str],
    started: asyncio.Event | None = None,
    job_ids: list[str] | None = None,
) -> Reply:
    """Stream one chat completion to its end; an error event ends it too.

    ``job_ids`` gets the server's job id (from the completion id) as soon as the first event
    arrives: every Redis key of the request derives from it, not from ``X-Request-Id``."""
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "stream": True,
        "messages": [{"role": "user", "content": content}],
    }
    parts: list[str] = []
    finish, error = "", None
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        request_id = resp.headers.get("x-request-id", "")
        if resp.status_code != 200:
            return Reply(request_id, "", "refused", json.loads(await resp.aread()))
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                break
            if job_ids is not None and not job_ids and "id" in event:
                job_ids.append(event["id"].removeprefix("chatcmpl-"))
            choice = event["choices"][0]
            parts.append(choice["delta"].get("content") or "")
            finish = choice["finish_reason"] or finish
            if started is not None:
                started.set()
    return Reply(request_id, "".join(parts), finish, error)


def expected_text(prompts: PromptBuilder, content: str, max_tokens: int) -> str:
    """What the simulated engine says to ``content``, uninterrupted."""
    request = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
    )
    ids = prompts.build(request).token_ids
    return "".join(simulated_text(simulated_token(ids, i)) for i in range(max_tokens))


@pytest.fixture
async def http_client() -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client; the base URL is given per request."""
    async with httpx.AsyncClient(timeout=180) as client:
        yield client
