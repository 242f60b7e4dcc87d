"""A real redis-server stopped and restarted under load: every request ends in a terminal
state (a whole reply or a clear error), requests during the outage get 503 at once, and the
gateway and worker recover by themselves.

Two restarts: with an append-only file (state survives; the production setting) and with
no persistence (everything queued is lost, which the gateway must notice)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from cluster.runtime.net import free_port
from cluster.runtime.redis_server import RedisServer
from cluster.wire.keys import Keys
from tests.fakes import FakeEngine
from tests.gateway.conftest import gateway_settings, serve_gateway
from tests.polling import eventually
from workers.loop.config import ConsumerConfig
from workers.loop.consumer import Consumer

MODEL = "smollm2-135m-instruct"
TOKENS = 40
EXPECTED = "".join(f" t{i}" for i in range(TOKENS))


async def _stream(http: httpx.AsyncClient, body: dict[str, object]) -> tuple[str, str]:
    """('ok', text) for a whole reply, ('error', detail) for a clear failure."""
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                detail = json.loads(await resp.aread())["error"]["code"]
                return "error", f"{resp.status_code} {detail}"
            text, finished = [], False
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "error", f"stream {event['error']['code']}"
                for choice in event["choices"]:
                    text.append(choice["delta"].get("content") or "")
                    finished = finished or choice.get("finish_reason") is not None
            return ("ok", "".join(text)) if finished else ("error", "cut without an error")
    except httpx.TransportError as exc:
        return "error", f"transport {exc!r}"


@pytest.mark.parametrize("persistence", ["aof", "none"])
async def test_redis_restart_under_load(model_path: str, tmp_path: Path, persistence: str) -> None:
    port = free_port()
    data_dir = tmp_path / "redis" if persistence == "aof" else None
    server = RedisServer(port, data_dir=data_dir).start()
    settings = gateway_settings(server.url, model_path)  # workers alive for 3 s of silence
    keys = Keys(settings.namespace)
    engine = FakeEngine(max_slots=6, delay_s=0.03)
    consumer = Consumer(server.url, keys, engine, ConsumerConfig(heartbeat_ms=200, lease_ms=3000))
    await consumer.start()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": TOKENS,
        "stream": True,
    }
    try:
        async with (
            serve_gateway(settings) as base_url,
            httpx.AsyncClient(
                base_url=base_url, timeout=60, headers={"X-Priority": "standard"}
            ) as http,
        ):
            await eventually(lambda: _ready(http), timeout_s=10)

            async def later(delay: float) -> tuple[str, str]:
                await asyncio.sleep(delay)
                return await _stream(http, {**body, "max_tokens": TOKENS})

            load = [asyncio.create_task(later(i * 0.02)) for i in range(30)]
            await asyncio.sleep(0.9)  # all accepted: some streaming, most queued
            server.stop_process()
            started = time.monotonic()
            during = await http.post("/v1/chat/completions", json={**body, "stream": False})
            answered_in = time.monotonic() - started
            await asyncio.sleep(1.5)
            server.start()
            async with asyncio.timeout(45):  # a hang fails here
                outcomes = await asyncio.gather(*load)
            # The service recovers without a restart.
            await eventually(lambda: _ready(http), timeout_s=15)
            after = await _stream(http, body)
    finally:
        engine.release.set()
        await consumer.close()
        server.stop()

    assert during.status_code == 503, during.text
    assert during.json()["error"]["code"] in ("unavailable", "timeout")
    assert answered_in < 1.0
    oks = [text for kind, text in outcomes if kind == "ok"]
    errors = [text for kind, text in outcomes if kind == "error"]
    assert all(text == EXPECTED for text in oks), "a reply was cut, repeated or reordered"
    assert all(("unavailable" in e or "lost" in e) for e in errors), errors
    assert oks, "nothing completed"
    if persistence == "aof":
        # State survived: every request accepted before the outage completed.
        assert len(oks) == len(load), errors
    else:
        # Everything queued was lost with Redis's memory, and said so.
        assert any("lost" in e for e in errors), errors
    assert after == ("ok", EXPECTED)


async def _ready(http: httpx.AsyncClient) -> bool:
    try:
        return (await http.get("/ready")).status_code == 200
    except httpx.TransportError:
        return False
