"""``charserve bench-tenants``: one tenant floods the cluster, another chats beside it.

Tenant A floods at ``--flood-factor`` (10) times the cluster's capacity, half with
batch-class jobs on short budgets (``--flood-budget-ms``) and half with interactive chats;
tenant B chats at ``--chat-share`` of capacity. Phases of ``--duration`` seconds alternate,
B alone then A and B together, for ``--rounds`` rounds, so both see the same machine. It
reports, per phase kind:

- B's TTFT p50/p99 and ITL p99, and the ratio of B's TTFT p99 with the flood over without;
- B's refusals (it should have none);
- A's refusals by drop reason, and how long a refusal at admission took (p50/p99): those
  answered with a status before any queueing. A request that was queued and then outlived
  its budget is refused when it expires, and is counted apart (``expired``);
- requests accepted (HTTP 200) whose stream then did not finish: lost work;
- Redis's used memory, sampled every 250 ms (peak), beside its ``maxmemory``.

Capacity is measured first: a closed loop of B's requests at ``--calibrate-concurrency``
for ``--calibrate-s`` seconds; completed requests per second.

The gateway must run with ``CHARSERVE_AUTH=keys``. The benchmark creates one key per
tenant in the gateways' Redis (``CHARSERVE_REDIS_URL``, or the running embedded stack's)
and revokes them at the end; ``--key-a``/``--key-b`` use existing keys instead.
``--flood-max-running`` gives A a cap on slots in flight (its limits), as an operator
would give a tenant that floods. Requests go
through :class:`~cluster.bench.lean_client.LeanClient`, so the flood costs the machine
little of the CPU the server needs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from cluster.bench.lean_client import LeanClient
from cluster.bench.load import USER_PROMPTS, request_body
from cluster.bench.samples import Sample, percentile
from cluster.runtime.redis_client import connect
from cluster.wire.keys import Keys
from cluster.wire.tenants import ApiKeys, Limits

PATH = "/v1/chat/completions"
_CODE = re.compile(rb'\\?"code\\?":\s*\\?"([a-z_]+)')


@dataclass
class Phase:
    """The samples of one phase, by tenant, and Redis's memory during it."""

    chat: list[Sample] = field(default_factory=list)  # tenant B
    flood: list[Sample] = field(default_factory=list)  # tenant A
    memory: list[int] = field(default_factory=list)
    wall_s: float = 0.0


def refusal_code(sample: Sample) -> str:
    """The error code of a refused request (from its error body), or ``""``."""
    found = _CODE.search(sample.error.encode())
    return found.group(1).decode() if found else ""


async def open_loop(
    send: Callable[[], Any], rate: float, rng: random.Random, stop: asyncio.Event
) -> list[Sample]:
    """Call ``send`` at Poisson arrivals of ``rate`` per second until ``stop``; then
    every sample, once all have finished."""
    tasks: list[asyncio.Task[Sample]] = []
    while not stop.is_set():
        tasks.append(asyncio.ensure_future(send()))
        try:
            await asyncio.wait_for(stop.wait(), rng.expovariate(rate))
        except TimeoutError:
            pass
    return list(await asyncio.gather(*tasks))


async def sample_memory(redis: aioredis.Redis | None, into: list[int], stop: asyncio.Event) -> None:
    """Redis's ``used_memory`` every 250 ms until ``stop``."""
    if redis is None:
        return
    while not stop.is_set():
        info: dict[str, Any] = await redis.info("memory")
        into.append(int(info["used_memory"]))
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except TimeoutError:
            pass


class Tenants:
    """The two tenants' requests, encoded once."""

    def __init__(self, args: argparse.Namespace, key_a: str, key_b: str) -> None:
        self.client = LeanClient(args.base_url)
        self._timeout_s = args.request_timeout_s

        def encoded(key: str, headers: dict[str, str]) -> list[bytes]:
            auth = {"Authorization": f"Bearer {key}", **headers}
            return [
                self.client.request_bytes(PATH, request_body(args.model, args.max_tokens, p), auth)
                for p in USER_PROMPTS
            ]

        self.chat = encoded(key_b, {"X-Priority": "interactive"})
        self.flood_chat = encoded(key_a, {"X-Priority": "interactive"})
        self.flood_batch = encoded(
            key_a, {"X-Priority": "batch", "X-Latency-Budget-Ms": str(args.flood_budget_ms)}
        )

    def sender(self, requests: list[bytes], rng: random.Random) -> Callable[[], Any]:
        """A function that sends one of ``requests`` (chosen at random) and times it."""
        return lambda: self.client.stream(rng.choice(requests), self._timeout_s)


async def calibrate(tenants: Tenants, concurrency: int, seconds: float) -> float:
    """Completed requests per second of B's requests in a closed loop."""
    rng = random.Random(7)
    stop_at = time.perf_counter() + seconds
    done = 0

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            sample = await tenants.client.stream(rng.choice(tenants.chat))
            if sample.status == 429:  # admission's "not now" at the closed loop's edge
                await asyncio.sleep(0.05)
                continue
            if not sample.ok:
                raise RuntimeError(f"calibration request failed: {sample.error}")
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - start)


async def run_phase(
    tenants: Tenants,
    args: argparse.Namespace,
    capacity: float,
    flood: bool,
    seed: int,
    redis: aioredis.Redis | None,
) -> Phase:
    """One phase: B chats; with ``flood``, A floods beside it."""
    phase = Phase()
    rng = random.Random(seed)
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(args.duration, stop.set)
    memory_stop = asyncio.Event()
    memory = asyncio.create_task(sample_memory(redis, phase.memory, memory_stop))
    start = time.perf_counter()
    loops = [open_loop(tenants.sender(tenants.chat, rng), args.chat_share * capacity, rng, stop)]
    if flood:
        half = args.flood_factor * capacity / 2
        loops.append(open_loop(tenants.sender(tenants.flood_chat, rng), half, rng, stop))
        loops.append(open_loop(tenants.sender(tenants.flood_batch, rng), half, rng, stop))
    results = await asyncio.gather(*loops)
    phase.wall_s = time.perf_counter() - start
    memory_stop.set()
    await memory
    phase.chat = results[0]
    for samples in results[1:]:
        phase.flood.extend(samples)
    return phase


def _ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1000, 1)


def chat_report(samples: list[Sample]) -> dict[str, Any]:
    """B's figures in one kind of phase."""
    ok = [s for s in samples if s.ok]
    itl = [gap for s in ok for gap in s.itl_s]
    return {
        "requests": len(samples),
        "refused": sum(1 for s in samples if s.status != 200),
        "refusal_codes": dict(Counter(refusal_code(s) for s in samples if s.status != 200)),
        "lost": sum(1 for s in samples if s.status == 200 and not s.ok),
        "ttft_p50_ms": _ms([s.ttft_s for s in ok], 50),
        "ttft_p99_ms": _ms([s.ttft_s for s in ok], 99),
        "itl_p99_ms": _ms(itl, 99),
    }


def flood_report(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    """A's figures: what was served, what was refused and how fast."""
    refused = [s for s in samples if s.status not in (0, 200)]
    expired = [s for s in refused if refusal_code(s) == "expired"]
    at_admission = [s for s in refused if refusal_code(s) != "expired"]
    ok = [s for s in samples if s.ok]
    return {
        "requests": len(samples),
        "served": len(ok),
        "refused_at_admission": len(at_admission),
        "refusal_codes": dict(Counter(refusal_code(s) for s in refused)),
        "refusal_p50_ms": _ms([s.e2e_s for s in at_admission], 50),
        "refusal_p99_ms": _ms([s.e2e_s for s in at_admission], 99),
        "expired_in_queue": len(expired),
        "no_response": sum(1 for s in samples if s.status == 0),
        "lost": sum(1 for s in samples if s.status == 200 and not s.ok),
        "output_tokens_per_s": round(sum(s.output_tokens for s in ok) / wall_s, 1),
    }


async def check_keys_mode(base_url: str) -> None:
    """Refuse to measure a gateway in open mode (both tenants would be ``default``)."""
    async with httpx.AsyncClient(timeout=10) as http:
        resp = await http.get(f"{base_url}/v1/models")
    if resp.status_code != 401:
        raise SystemExit(
            "bench-tenants needs a gateway with CHARSERVE_AUTH=keys (without a key "
            f"/v1/models answered {resp.status_code}, not 401)"
        )


async def bench_tenants(args: argparse.Namespace, redis_url: str, namespace: str) -> dict[str, Any]:
    """Calibrate, then alternate phases without and with the flood (``redis_url`` and
    ``namespace``: the gateways' Redis, for the keys and the memory samples)."""
    await check_keys_mode(args.base_url)
    redis: aioredis.Redis | None = None
    created: list[tuple[str, str]] = []
    key_a, key_b = args.key_a, args.key_b
    try:
        if not (key_a and key_b) or not args.no_memory:
            if not redis_url:
                raise SystemExit(
                    "bench-tenants needs the gateways' Redis (CHARSERVE_REDIS_URL, or a "
                    "running `charserve up`) unless given --key-a, --key-b and --no-memory"
                )
            redis = connect(redis_url, max_connections=4)
        if not (key_a and key_b):
            assert redis is not None
            api_keys = ApiKeys(redis, Keys(namespace))
            run_id = secrets.token_hex(3)
            key_a, record_a = await api_keys.create(f"bench-flood-{run_id}", "bench-tenants")
            if args.flood_max_running:
                await api_keys.set_limits(
                    record_a.tenant, Limits(max_running=args.flood_max_running)
                )
            key_b, record_b = await api_keys.create(f"bench-chat-{run_id}", "bench-tenants")
            created = [(record_a.id, record_a.tenant), (record_b.id, record_b.tenant)]
        tenants = Tenants(args, key_a, key_b)
        try:
            capacity = args.capacity or await calibrate(
                tenants, args.calibrate_concurrency, args.calibrate_s
            )
            phases: dict[str, list[Phase]] = {"alone": [], "flood": []}
            for round_no in range(args.rounds):
                for kind in ("alone", "flood"):
                    phases[kind].append(
                        await run_phase(tenants, args, capacity, kind == "flood", round_no, redis)
                    )
        finally:
            tenants.client.close()
        maxmemory = 0
        if redis is not None and not args.no_memory:
            maxmemory = int((await redis.config_get("maxmemory")).get("maxmemory") or 0)
    finally:
        if redis is not None:
            if created:
                api_keys = ApiKeys(redis, Keys(namespace))
                for key_id, tenant in created:
                    await api_keys.revoke(key_id)
                    await api_keys.clear_limits(tenant)
            await redis.aclose()
    report: dict[str, Any] = {"capacity_rps": round(capacity, 2)}
    for kind, runs in phases.items():
        wall = sum(p.wall_s for p in runs)
        memory = [m for p in runs for m in p.memory]
        report[kind] = {
            "chat": chat_report([s for p in runs for s in p.chat]),
            "redis_used_memory_peak_mb": round(max(memory) / 2**20, 1) if memory else None,
        }
        if kind == "flood":
            report[kind]["flood"] = flood_report([s for p in runs for s in p.flood], wall)
    alone, flooded = report["alone"]["chat"], report["flood"]["chat"]
    report["summary"] = {
        "chat_ttft_p99_flood_over_alone": round(flooded["ttft_p99_ms"] / alone["ttft_p99_ms"], 2),
        "chat_refused": alone["refused"] + flooded["refused"],
        "flood_refusal_p99_ms": report["flood"]["flood"]["refusal_p99_ms"],
        "accepted_then_lost": alone["lost"] + flooded["lost"] + report["flood"]["flood"]["lost"],
        "redis_maxmemory_mb": round(maxmemory / 2**20, 1) if maxmemory else None,
    }
    return {"workload": vars(args) | {"key_a": None, "key_b": None}, "report": report}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``charserve bench-tenants``."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--key-a", default=None, help="the flooding tenant's key")
    parser.add_argument("--key-b", default=None, help="the chatting tenant's key")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--flood-factor", type=float, default=10.0, help="A's rate / capacity")
    parser.add_argument("--flood-budget-ms", type=int, default=1500, help="A's batch budget")
    parser.add_argument(
        "--flood-max-running",
        type=int,
        default=0,
        help="A's cap on jobs running at once, set in its limits (0: the defaults)",
    )
    parser.add_argument("--chat-share", type=float, default=0.2, help="B's rate / capacity")
    parser.add_argument(
        "--capacity", type=float, default=0.0, help="requests/s (0: measure it first)"
    )
    parser.add_argument("--calibrate-concurrency", type=int, default=16)
    parser.add_argument("--calibrate-s", type=float, default=15.0)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per phase")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--no-memory", action="store_true", help="do not sample Redis's memory")
    parser.add_argument("--output", default=None, help="write the JSON result here")


def run(args: argparse.Namespace, redis_url: str, namespace: str) -> int:
    """Run ``charserve bench-tenants`` and print the report."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    result = asyncio.run(bench_tenants(args, redis_url, namespace))
    report = result["report"]
    print(f"capacity: {report['capacity_rps']} requests/s")
    for kind in ("alone", "flood"):
        print(f"{kind}: chat {json.dumps(report[kind]['chat'])}")
        if kind == "flood":
            print(f"flood: {json.dumps(report[kind]['flood'])}")
        print(f"{kind}: redis used memory peak {report[kind]['redis_used_memory_peak_mb']} MB")
    for key, value in report["summary"].items():
        print(f"{key}: {value}")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))
    return 0
