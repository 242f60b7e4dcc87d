"""The benchmark's load generator against a real gateway: it measures what it claims."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from cluster.bench.lean_client import LeanClient
from cluster.bench.load import (
    one_request,
    parse_headers,
    poisson_stream,
    request_body,
    run_round_procs,
)
from tests.gateway.conftest import Gateway

MODEL = "smollm2-135m-instruct"


async def test_one_request_measures_a_stream(gateway: Gateway) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        sample = await one_request(client, gateway.base_url, MODEL, 6, "hello")
    assert sample.ok, sample.error
    assert sample.output_tokens == 6 and sample.text == "".join(f" t{i}" for i in range(6))
    assert 0 < sample.ttft_s <= sample.e2e_s and len(sample.itl_s) == 5
    assert sample.prompt_tokens > 0


async def test_poisson_stream_sends_until_stopped(gateway: Gateway) -> None:
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=30) as client:
        asyncio.get_running_loop().call_later(0.5, stop.set)
        samples = await poisson_stream(
            client, gateway.base_url, MODEL, 3, 40.0, random.Random(1), {}, stop
        )
    # 40/s for 0.5 s: about 20 arrivals; all answered, none lost.
    assert 5 <= len(samples) <= 60
    assert all(s.ok for s in samples), [s.error for s in samples if not s.ok]


async def test_lean_client_measures_what_httpx_measures(gateway: Gateway) -> None:
    lean = LeanClient(gateway.base_url)
    request = lean.request_bytes("/v1/chat/completions", request_body(MODEL, 6, "hello"), {})
    try:
        # Twice: the second request reuses the keep-alive connection.
        for _ in range(2):
            sample = await lean.stream(request)
            assert sample.ok, sample.error
            assert sample.output_tokens == 6
            assert sample.text == "".join(f" t{i}" for i in range(6))
            assert 0 < sample.ttft_s <= sample.e2e_s
            # A gap per event with text after the first: 5 when each token has its own
            # event; fewer when, on a loaded machine, two tokens reach the client in one event.
            assert 1 <= len(sample.itl_s) <= 5
            assert sample.prompt_tokens > 0
    finally:
        lean.close()


async def test_lean_client_reports_an_http_error(gateway: Gateway) -> None:
    lean = LeanClient(gateway.base_url)
    body = request_body("no-such-model", 6, "hello")
    try:
        sample = await lean.stream(lean.request_bytes("/v1/chat/completions", body, {}))
    finally:
        lean.close()
    assert not sample.ok and sample.error.startswith("HTTP 404")


async def test_a_round_spread_over_processes_keeps_every_sample(gateway: Gateway) -> None:
    before = time.perf_counter()
    samples, wall_s, cpu_s = await run_round_procs(
        2,
        url=gateway.base_url,
        model=MODEL,
        requests=5,
        concurrency=3,
        rate=None,
        max_tokens=4,
        seed=1,
        headers={},
        client="lean",
        ramp_s=0.1,
    )
    after = time.perf_counter()
    assert len(samples) == 5 and wall_s > 0 and cpu_s > 0
    # Each process stamps its requests on the system's monotonic clock, the one this
    # process (and bench-peers' CPU counters) reads: their gaps can be placed in time.
    assert all(before < s.start_s < after for s in samples)
    assert all(s.ok and s.output_tokens == 4 for s in samples), [s.error for s in samples]


def test_header_options_are_name_value_pairs_and_a_malformed_one_is_named() -> None:
    assert parse_headers(["X-Priority: standard", "X-Latency-Budget-Ms:500"]) == {
        "X-Priority": "standard",
        "X-Latency-Budget-Ms": "500",
    }
    for bad in ("X-Priority standard", ": standard"):
        with pytest.raises(SystemExit, match="--header"):
            parse_headers([bad])
