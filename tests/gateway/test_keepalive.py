"""SSE keep-alives: a streamed request that waits in the queue gets its 200 and comment lines
until its first token, through real uvicorn, Redis and a consumer whose one slot is held."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest

from cluster.wire.keys import Keys
from gateway.streaming.socket_writer import ConnectionWriter
from gateway.streaming.sse import KEEPALIVE
from tests.fakes import FakeEngine
from tests.gateway.conftest import Gateway, gateway_settings, serve_gateway
from tests.polling import eventually
from workers.loop.config import ConsumerConfig
from workers.loop.consumer import Consumer

MODEL = "smollm2-135m-instruct"
INTERVAL_S = 0.3
HOLD_S = 1.3  # how long the engine's one slot stays busy: about four intervals
BODY: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 3,
    "stream": True,
}
# A 30 s budget: the request may wait out the hold in the queue.
STANDARD = {"X-Priority": "standard"}
# A budget that expires in the queue while the slot is held, yet that admission accepts:
# with the slot busy it estimates the wait as one completion at the worker's measured rate
# (about a second here, slower after holds in which nothing finished), so 1 s was refused
# as "budget" whenever a rate had been reported before the request.
EXPIRING = {**STANDARD, "X-Latency-Budget-Ms": "4000"}


@asynccontextmanager
async def stack(redis_url: str, model_path: str, **settings: object) -> AsyncIterator[Gateway]:
    """A gateway and a consumer whose engine has one slot."""
    # The production heartbeat: a worker is alive for 3 s without one (the 200 ms of the
    # other gateway tests read a busy machine's late beat as no worker, a 503).
    values: dict[str, object] = {"sse_keepalive_s": INTERVAL_S, "heartbeat_ms": 1000, **settings}
    config = gateway_settings(redis_url, model_path, **values)
    keys = Keys(config.namespace)
    engine = FakeEngine(max_slots=1, delay_s=0.002)
    consumer = Consumer(
        redis_url, keys, engine, ConsumerConfig(heartbeat_ms=1000, batch_reserve_slots=0)
    )
    await consumer.start()
    try:
        async with serve_gateway(config) as base_url:
            async with httpx.AsyncClient(base_url=base_url, timeout=5) as client:

                async def ready() -> bool:  # the gateway has seen the worker's heartbeat
                    return (await client.get("/ready")).status_code == 200

                await eventually(ready)
            yield Gateway(base_url, engine, keys, config)
    finally:
        engine.release.set()
        await consumer.close()


@pytest.fixture(scope="module")
async def gateway(redis_url: str, model_path: str) -> AsyncIterator[Gateway]:
    async with stack(redis_url, model_path) as gw:
        yield gw


@pytest.fixture
async def http(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as client:
        yield client


@asynccontextmanager
async def slot_held(gw: Gateway, http: httpx.AsyncClient) -> AsyncIterator[None]:
    """The engine's one slot is busy (a reply that cannot start) until the block ends, so
    whatever is sent meanwhile waits in the queue."""
    gw.engine.release.clear()
    body = {**BODY, "stream": False, "max_tokens": 1}
    # Batch: its long "prefill" (the hold) stays out of what admission estimates from.
    headers = {"X-Priority": "batch"}
    blocker = asyncio.create_task(http.post("/v1/chat/completions", json=body, headers=headers))
    try:
        await gw.engine.wait_until(lambda: gw.engine.running == 1)
        yield
    finally:
        gw.engine.release.set()
        assert (await blocker).status_code == 200


async def read_stream(
    http: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str]
) -> tuple[httpx.Response, float, list[tuple[float, bytes]]]:
    """The response, when its head arrived, and each read of its body with its time (s
    after the request was sent)."""
    start = time.monotonic()
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        head_s = time.monotonic() - start
        reads = [(time.monotonic() - start, data) async for data in resp.aiter_raw()]
    return resp, head_s, reads


def events(raw: bytes) -> list[str]:
    """The data of each SSE event, comments dropped (what an SSE parser sees)."""
    out = []
    for block in raw.decode().split("\n\n"):
        data = [line[6:] for line in block.split("\n") if line.startswith("data: ")]
        if data:
            out.append("\n".join(data))
    return out


def text_of(datas: list[str]) -> str:
    chunks = [json.loads(d) for d in datas if d != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


async def held_stream(
    gw: Gateway, http: httpx.AsyncClient, body: dict[str, Any] = BODY, hold_s: float = HOLD_S
) -> tuple[httpx.Response, float, list[tuple[float, bytes]]]:
    """Stream ``body`` while the slot is held for ``hold_s``."""
    async with slot_held(gw, http):
        reader = asyncio.create_task(read_stream(http, body, STANDARD))
        await asyncio.sleep(hold_s)
    return await reader


async def test_a_waiting_stream_gets_keep_alives_at_the_interval_then_its_tokens(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    resp, head_s, reads = await held_stream(gateway, http)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    # The head went out once the request had waited one interval, not at once.
    assert INTERVAL_S * 0.8 <= head_s < HOLD_S
    raw = b"".join(data for _, data in reads)
    times = [t for t, data in reads if data == KEEPALIVE]
    assert raw.startswith(KEEPALIVE)
    assert 2 <= raw.count(KEEPALIVE) <= round(HOLD_S / INTERVAL_S) + 1
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps and all(INTERVAL_S * 0.6 <= g <= INTERVAL_S * 2.5 for g in gaps), gaps
    # Then the reply, whole, and nothing but comments before it.
    assert raw.rstrip().endswith(b"data: [DONE]")
    assert re.fullmatch(rb"(: keep-alive\n\n)+:\n\ndata: .*", raw, re.DOTALL)
    assert text_of(events(raw)) == " t0 t1 t2"


async def test_a_stream_answered_within_the_interval_has_no_keep_alive(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    resp, _, reads = await read_stream(http, BODY, {})
    raw = b"".join(data for _, data in reads)
    assert resp.status_code == 200 and raw.startswith(b"data: ") and b": keep" not in raw


async def test_an_error_after_keep_alives_is_an_sse_error_event(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    async with slot_held(gateway, http):
        gateway.engine.fail_with = "boom"  # the held reply already started: only the next
        reader = asyncio.create_task(read_stream(http, BODY, STANDARD))
        await asyncio.sleep(HOLD_S)
    try:
        resp, _, reads = await reader
    finally:
        gateway.engine.fail_with = None
    raw = b"".join(data for _, data in reads)
    assert resp.status_code == 200 and raw.startswith(KEEPALIVE)
    datas = events(raw)
    assert datas[-1] == "[DONE]" and len(datas) == 2
    error = json.loads(datas[0])["error"]
    assert error["code"] == "internal_error" and "boom" in error["message"]
    assert error["type"] == "server_error"


async def test_a_request_that_expires_after_keep_alives_gets_an_expired_event(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    # Withdrawn from the queue a second after its deadline, while the slot is held.
    async with slot_held(gateway, http):
        resp, _, reads = await read_stream(http, BODY, EXPIRING)
    raw = b"".join(data for _, data in reads)
    assert resp.status_code == 200 and raw.count(KEEPALIVE) >= 3
    error = json.loads(events(raw)[0])["error"]
    assert error["code"] == "expired" and error["type"] == "rate_limit_error"
    assert resp.headers["x-request-id"] not in gateway.engine.started


async def test_the_openai_client_reads_through_keep_alives_and_raises_on_a_late_error(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused")

    async def stream_text() -> str:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            stream=True,
            extra_headers=STANDARD,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    try:
        async with slot_held(gateway, http):
            reader = asyncio.create_task(stream_text())
            await asyncio.sleep(HOLD_S)
        assert await reader == " t0 t1 t2 t3"
        async with slot_held(gateway, http):
            gateway.engine.fail_with = "boom"
            failing = asyncio.create_task(stream_text())
            await asyncio.sleep(HOLD_S)
        with pytest.raises(openai.APIError, match="boom"):
            await failing
    finally:
        gateway.engine.fail_with = None
        await client.close()


async def test_vllm_benchmark_client_reads_a_stream_with_keep_alives(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    """vLLM's ``vllm bench serve`` client strips each read before buffering it: a lone
    keep-alive would swallow the next event but for the empty comment sent with it."""
    # A gateway-only install has no vLLM: the client under test is vLLM's own.
    pytest.importorskip("vllm", reason="vLLM's benchmark client is installed with vLLM")
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncInput,
        async_request_openai_chat_completions,
    )

    async def ready() -> bool:  # importing vLLM held the loop: heartbeats were late
        return (await http.get("/ready")).status_code == 200

    await eventually(ready)
    async with aiohttp.ClientSession() as session:
        async with slot_held(gateway, http):
            # Its default class (interactive, 2 s) waits out the hold.
            reader = asyncio.create_task(
                async_request_openai_chat_completions(
                    RequestFuncInput(
                        prompt="Hello",
                        api_url=f"{gateway.base_url}/v1/chat/completions",
                        prompt_len=2,
                        output_len=5,
                        model=MODEL,
                    ),
                    session,
                )
            )
            await asyncio.sleep(HOLD_S)
        out = await reader
    assert out.success, out.error
    assert out.generated_text == " t0 t1 t2 t3 t4"
    assert out.ttft >= HOLD_S * 0.9  # the first token, not the first keep-alive


async def test_ttft_counts_the_first_token_not_a_keep_alive(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    async def ttft() -> tuple[float, float]:
        page = (await http.get("/metrics")).text
        found = {
            name: float(value)
            for name, value in re.findall(
                r'^charserve_ttft_seconds_(sum|count)\{priority="standard"\} (\S+)$',
                page,
                re.MULTILINE,
            )
        }
        return found.get("sum", 0.0), found.get("count", 0.0)

    before = await ttft()
    resp, _, reads = await held_stream(gateway, http)
    assert resp.status_code == 200 and reads[0][1] == KEEPALIVE
    after = await ttft()
    assert after[1] == before[1] + 1
    assert after[0] - before[0] >= HOLD_S * 0.9


async def test_tokens_after_keep_alives_still_go_straight_to_the_socket(
    gateway: Gateway, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[bytes] = []
    original = ConnectionWriter.write

    def spy(self: ConnectionWriter, data: bytes) -> bool:
        written = original(self, data)
        if written:
            writes.append(data)
        return written

    monkeypatch.setattr(ConnectionWriter, "write", spy)
    gateway.engine.delay_s = 0.02  # the reader is waiting when each token arrives
    try:
        resp, _, reads = await held_stream(gateway, http, {**BODY, "max_tokens": 30})
        assert resp.status_code == 200
    finally:
        gateway.engine.delay_s = 0.002
    raw = b"".join(data for _, data in reads)
    assert raw.startswith(KEEPALIVE)
    assert text_of(events(raw)) == "".join(f" t{i}" for i in range(30))
    assert len(writes) >= 15 and all(w in raw for w in writes)


async def test_a_client_that_leaves_during_keep_alives_cancels_its_job(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    async with slot_held(gateway, http):
        async with http.stream("POST", "/v1/chat/completions", json=BODY, headers=STANDARD) as resp:
            job_id = resp.headers["x-request-id"]
            async for data in resp.aiter_raw():
                assert data == KEEPALIVE
                break  # and the connection closes
        await asyncio.sleep(0.3)  # the cancel reaches the queue
    await asyncio.sleep(0.5)  # the slot is free: a job still queued would start now
    assert job_id not in gateway.engine.started


async def test_a_resumable_stream_left_during_keep_alives_runs_on_and_resumes(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    body = {**BODY, "max_tokens": 5}
    async with slot_held(gateway, http):
        async with http.stream(
            "POST",
            "/v1/chat/completions",
            json=body,
            headers={**STANDARD, "X-Resumable": "true"},
        ) as resp:
            job_id = resp.headers["x-request-id"]
            async for data in resp.aiter_raw():
                assert data == KEEPALIVE
                break
        await asyncio.sleep(0.3)
    await gateway.engine.wait_until(lambda: job_id in gateway.engine.started)
    resumed = await http.get(f"/v1/chat/completions/chatcmpl-{job_id}/events")
    assert resumed.status_code == 200
    assert text_of(events(resumed.content)) == " t0 t1 t2 t3 t4"


async def test_an_attached_stream_gets_keep_alives_too(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    """A request sent again with its X-Request-Id reads the first one's reply from its log,
    with keep-alives while that reply waits."""
    headers = {**STANDARD, "X-Request-Id": f"again-{time.monotonic_ns()}"}
    async with slot_held(gateway, http):
        first = asyncio.create_task(read_stream(http, BODY, headers))
        await asyncio.sleep(0.1)
        again = asyncio.create_task(read_stream(http, BODY, headers))
        await asyncio.sleep(HOLD_S + 1.0)  # the log reader ticks once a second
    (_, _, first_reads), (resp, _, reads) = await first, await again
    raw = b"".join(data for _, data in reads)
    assert resp.status_code == 200 and raw.startswith(KEEPALIVE)
    assert text_of(events(raw)) == text_of(events(b"".join(d for _, d in first_reads)))


async def test_keep_alives_off_leave_the_status_to_the_first_token(
    redis_url: str, model_path: str
) -> None:
    async with stack(redis_url, model_path, sse_keepalive_s=0) as gw:
        async with httpx.AsyncClient(base_url=gw.base_url, timeout=30) as client:
            resp, head_s, reads = await held_stream(gw, client)
            assert resp.status_code == 200 and head_s >= HOLD_S * 0.9
            raw = b"".join(data for _, data in reads)
            assert b": keep" not in raw and text_of(events(raw)) == " t0 t1 t2"
            # An error before the first token is still a status, as without keep-alives.
            async with slot_held(gw, client):
                late = await client.post("/v1/chat/completions", json=BODY, headers=EXPIRING)
            assert late.status_code == 429 and late.json()["error"]["code"] == "expired"


async def test_without_tracing_a_job_carries_no_traceparent(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    """Tracing is off here (tests/gateway/test_tracing.py has it on): a client's trace
    header is not read, and the job's field stays empty."""
    resp = await http.post(
        "/v1/chat/completions",
        json={**BODY, "stream": False},
        headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    )
    assert resp.status_code == 200
    assert gateway.engine.jobs[resp.headers["x-request-id"]].traceparent == ""
