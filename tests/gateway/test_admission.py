"""Admission by latency budget: the estimate, and refusals answered without a worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from cluster.runtime.clock import RedisClock
from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import Job, WorkerStats
from cluster.wire.queue import JobQueue, Position
from cluster.wire.vocabulary import DropReason
from gateway.chat.admission import (
    CLAIM_LAG_MS,
    UNREPORTED_MAX_AGE_MS,
    Admitter,
    RecentAdmissions,
    RefusalLog,
    Rejection,
    capped_wait_ms,
    estimate_ttft_ms,
)
from gateway.chat.capacity import Capacity, CapacityView, summarize
from gateway.http.errors import APIError
from tests.gateway.conftest import gateway_settings, serve_gateway
from tests.polling import eventually

MODEL = "smollm2-135m-instruct"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_estimate_uses_free_slots_then_the_drain_rate() -> None:
    cap = Capacity(workers=1, free_slots=2, completed_per_s=4.0, prefill_ms=50.0)
    assert estimate_ttft_ms(cap, ahead=0) == 50.0
    assert estimate_ttft_ms(cap, ahead=1) == 50.0
    # 5 ahead, 2 free: 4 must finish first, at 4 per second.
    assert estimate_ttft_ms(cap, ahead=5) == pytest.approx(1050.0)
    # No drain rate measured yet: the wait is unknown, only the request's own prefill counts.
    assert estimate_ttft_ms(Capacity(workers=1), ahead=3) == 0.0


def test_the_estimate_has_a_floor_and_grows_with_the_prompt() -> None:
    idle = Capacity(workers=1, free_slots=4)
    # Nothing measured yet: the floor still refuses a 1 ms budget.
    assert estimate_ttft_ms(idle, ahead=0, prompt_tokens=50, floor_ms=10.0) == 10.0
    measured = Capacity(workers=1, free_slots=4, prefill_ms=30.0, prefill_ms_per_token=0.5)
    assert estimate_ttft_ms(measured, ahead=0, prompt_tokens=20) == 30.0
    assert estimate_ttft_ms(measured, ahead=0, prompt_tokens=1000) == 500.0


def test_the_estimate_waits_for_the_prompt_tokens_queued_in_the_engine() -> None:
    # 1,200 ms of prompt tokens await their prefill: a short prompt waits for them and
    # its own 80 tokens; one of 1,000 tokens for them and its own.
    cap = Capacity(
        workers=1, free_slots=90, prefill_ms=40.0, prefill_ms_per_token=0.5, prefill_queued_ms=1200
    )
    assert estimate_ttft_ms(cap, ahead=0, prompt_tokens=80) == pytest.approx(1240.0)
    assert estimate_ttft_ms(cap, ahead=0, prompt_tokens=1000) == pytest.approx(1700.0)


def test_a_tenant_at_its_cap_waits_for_its_own_slots() -> None:
    # 16 slots all busy, 8 finishing per second: half a job per slot per second.
    cap = Capacity(workers=1, slots=16, free_slots=0, completed_per_s=8.0)
    # Capped at 2 running (and running 2): its jobs start at 1 per second.
    assert capped_wait_ms(cap, own_ahead=3, running=2, max_running=2) == pytest.approx(4000.0)
    # Below its cap, or with no cap, the tenant waits as everyone does.
    assert capped_wait_ms(cap, own_ahead=3, running=1, max_running=2) == 0.0
    assert capped_wait_ms(cap, own_ahead=3, running=2, max_running=0) == 0.0


def test_summary_ignores_draining_workers() -> None:
    stats = [
        WorkerStats(
            worker_id="a", max_slots=8, running=2, ts_ms=0, completed_per_s=1.0, prefill_ms=80
        ),
        WorkerStats(
            worker_id="b", max_slots=8, running=0, ts_ms=0, draining=True, completed_per_s=9
        ),
    ]
    cap = summarize(stats, waiting=3, now_s=0.0)
    assert (cap.workers, cap.free_slots, cap.completed_per_s, cap.prefill_ms) == (1, 6, 1.0, 80)
    assert cap.slots == 8


def test_the_figures_are_as_recent_as_the_oldest_live_workers() -> None:
    def stats(worker_id: str, ts_ms: int, at_ms: int) -> WorkerStats:
        return WorkerStats(worker_id=worker_id, max_slots=8, running=0, ts_ms=ts_ms, at_ms=at_ms)

    # One rewrote its figures at 1,500, one last beat at 1,200 (an older build: no at_ms).
    cap = summarize([stats("a", 1_000, 1_500), stats("b", 1_200, 0)], waiting=0, now_s=0.0)
    assert cap.reported_ms == 1_200
    assert summarize([], waiting=0, now_s=0.0).reported_ms == 0


def test_recent_admissions_count_what_the_figures_do_not_show_yet() -> None:
    recent = RecentAdmissions()
    for at_ms, tokens in [(1_000, 50), (1_010, 0), (1_040, 200)]:
        recent.add(at_ms, tokens)
    # Figures taken at 1,000 cannot show any of them; at 1,035 the first two were claimed.
    assert recent.unreported(1_000, now_ms=1_050) == (3, 250)
    assert recent.unreported(1_010 + CLAIM_LAG_MS, now_ms=1_050) == (1, 200)
    # Figures that stop moving do not keep an admission counted for ever.
    assert recent.unreported(0, now_ms=1_040 + UNREPORTED_MAX_AGE_MS) == (0, 0)


async def _heartbeat(redis: aioredis.Redis, keys: Keys, stats: WorkerStats) -> None:
    """Announce a worker that claims nothing, as a real one would announce itself."""
    await redis.zadd(keys.workers, {stats.worker_id: stats.ts_ms})
    await redis.set(keys.worker_stats(stats.worker_id), protocol.encode(stats), px=60_000)


async def test_the_capacity_view_reads_live_workers_and_the_queue(
    redis: aioredis.Redis, keys: Keys
) -> None:
    """One refresh sees the workers whose heartbeat is fresh by Redis's clock (not a stale
    one, nor one whose stats expired), counts the queue, and follows Redis's clock."""
    now = time.time_ns() // 1_000_000
    for worker_id, beat_ms in (("fresh", now), ("stale", now - 10_000)):
        await _heartbeat(
            redis, keys, WorkerStats(worker_id=worker_id, max_slots=4, running=1, ts_ms=beat_ms)
        )
    await redis.zadd(keys.workers, {"expired": now})  # its stats key is gone
    await redis.zadd(keys.queue, {"a": 1, "b": 2})
    clock = RedisClock(local=lambda: 0)
    view = CapacityView(redis, keys, heartbeat_ms=1000, clock=clock)
    snapshot = await view.refresh()
    assert (snapshot.workers, snapshot.free_slots, snapshot.waiting) == (1, 3, 2)
    assert list(snapshot.free_by_worker) == ["fresh"]
    assert abs(clock.now_ms() - time.time_ns() // 1_000_000) < 5_000


async def test_the_capacity_view_closes_without_waiting_out_its_period(
    redis: aioredis.Redis, keys: Keys
) -> None:
    """Closing cancels the wait between two refreshes: a long period does not hold a
    gateway's shutdown."""
    view = CapacityView(redis, keys, heartbeat_ms=1000, refresh_ms=600_000)
    await view.start()
    await asyncio.sleep(0)
    await asyncio.wait_for(view.close(), timeout=5.0)


@pytest.fixture
async def busy_cluster(
    redis_url: str, model_path: str, redis: aioredis.Redis
) -> AsyncIterator[tuple[str, Keys]]:
    """A gateway in front of one saturated worker (no free slot, 2 jobs/s) and 6 waiting jobs."""
    settings = gateway_settings(redis_url, model_path, max_queued=8)
    keys = Keys(settings.namespace)
    now = time.time_ns() // 1_000_000
    await _heartbeat(
        redis,
        keys,
        WorkerStats(
            worker_id="w",
            max_slots=4,
            running=4,
            ts_ms=now + 600_000,
            completed_per_s=2.0,
            prefill_ms=100.0,
        ),
    )
    # Its four running jobs hold leases, as claimed jobs do.
    await redis.zadd(keys.leases, {f"running{i}": now + 600_000 for i in range(4)})
    queue = JobQueue(redis, keys)
    for i in range(6):
        await queue.enqueue(
            Job(
                id=f"q{i}",
                reply_to="x",
                model=MODEL,
                prompt_token_ids=[1],
                max_tokens=1,
                sampling={},
                arrival_ms=now,
                deadline_ms=now + 1000 + i,
            )
        )
    async with serve_gateway(settings) as base_url:
        yield base_url, keys


async def test_infeasible_budget_is_refused_at_once(
    busy_cluster: tuple[str, Keys], redis: aioredis.Redis
) -> None:
    base_url, keys = busy_cluster
    async with httpx.AsyncClient(base_url=base_url) as http:
        resp = await http.post(
            "/v1/chat/completions", json=BODY, headers={"X-Latency-Budget-Ms": "1500"}
        )
    assert resp.status_code == 429
    assert resp.headers["x-charserve-drop-reason"] == "budget"
    error = resp.json()["error"]
    assert error["code"] == "budget" and "6 requests ahead" in error["message"]
    # Asked to come back when the estimate (7 to finish at 2/s, then 100 ms) fits 1.5 s.
    assert resp.headers["retry-after-ms"] == "2100" and resp.headers["retry-after"] == "3"
    assert await redis.zcard(keys.queue) == 6  # nothing was queued


async def test_feasible_budget_and_batch_are_admitted(
    busy_cluster: tuple[str, Keys], redis: aioredis.Redis
) -> None:
    base_url, keys = busy_cluster
    async with httpx.AsyncClient(base_url=base_url, timeout=2) as http:
        for headers in ({"X-Latency-Budget-Ms": "60000"}, {"X-Priority": "batch"}):
            # Admitted, so it waits for a worker that never comes: the client gives up.
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/chat/completions", json=BODY, headers=headers)

    # Both were queued, then dequeued when the client went away (asynchronously).
    async def back_to_six() -> bool:
        return await redis.zcard(keys.queue) == 6

    await eventually(back_to_six)


async def test_a_batch_request_with_a_short_budget_is_judged_like_any_other(
    busy_cluster: tuple[str, Keys], redis: aioredis.Redis
) -> None:
    base_url, keys = busy_cluster
    async with httpx.AsyncClient(base_url=base_url) as http:
        resp = await http.post(
            "/v1/chat/completions",
            json=BODY,
            headers={"X-Priority": "batch", "X-Latency-Budget-Ms": "1500"},
        )
    # Behind all 6 waiting jobs it cannot start within 1.5 s: refused now, not expired later.
    assert resp.status_code == 429 and resp.headers["x-charserve-drop-reason"] == "budget"
    assert await redis.zcard(keys.queue) == 6


async def test_queue_bound_refuses_even_batch(
    busy_cluster: tuple[str, Keys], redis: aioredis.Redis
) -> None:
    base_url, keys = busy_cluster
    await redis.zadd(keys.queue, {"filler1": 10**13, "filler2": 10**13})
    await asyncio.sleep(0.3)  # the gateway's capacity snapshot refreshes every 100 ms
    async with httpx.AsyncClient(base_url=base_url) as http:
        resp = await http.post("/v1/chat/completions", json=BODY, headers={"X-Priority": "batch"})
    assert resp.status_code == 429 and resp.headers["x-charserve-drop-reason"] == "queue_full"


async def test_no_workers_is_a_503(redis_url: str, model_path: str) -> None:
    settings = gateway_settings(redis_url, model_path)
    async with serve_gateway(settings) as base_url, httpx.AsyncClient(base_url=base_url) as http:
        resp = await http.post("/v1/chat/completions", json=BODY)
    assert resp.status_code == 503
    assert resp.headers["x-charserve-drop-reason"] == "no_workers" and resp.headers["retry-after"]


async def test_ready_agrees_with_admission(
    redis_url: str, model_path: str, redis: aioredis.Redis
) -> None:
    """A worker whose heartbeat is in but whose stats are not is no worker to admission;
    /ready must not say 200 to a client whose next request admission refuses (CI saw
    exactly that when the capacity snapshot lagged the heartbeat)."""
    settings = gateway_settings(redis_url, model_path)
    keys = Keys(settings.namespace)
    async with serve_gateway(settings) as base_url, httpx.AsyncClient(base_url=base_url) as http:
        seconds, _ = await redis.time()
        await redis.zadd(keys.workers, {"half-registered": (seconds + 60) * 1000})
        await asyncio.sleep(0.3)  # past a snapshot refresh (every 100 ms)
        ready = await http.get("/ready")
        chat = await http.post("/v1/chat/completions", json=BODY)
    assert chat.status_code == 503 and chat.headers["x-charserve-drop-reason"] == "no_workers"
    assert ready.status_code == 503 and ready.json()["reason"] == "no_workers"


def _job(prompt_tokens: int, max_tokens: int) -> Job:
    """An interactive job with a 2 s budget, for decisions made without a queue."""
    return Job(
        id="j",
        reply_to="x",
        model=MODEL,
        prompt_token_ids=[1] * prompt_tokens,
        max_tokens=max_tokens,
        sampling={},
        arrival_ms=0,
        deadline_ms=2_000,
    )


class _View:
    """A capacity view whose snapshot is a beat old."""

    def __init__(self, capacity: Capacity) -> None:
        self.current = capacity
        self.refresh_ms = 100
        self.clock = RedisClock()


class _Queue:
    def __init__(self, position: Position) -> None:
        self._position = position
        self.asked = 0

    async def position(self, job: Job) -> Position:
        self.asked += 1
        return self._position


async def _admitted(admitter: Admitter, jobs: int, prompt_tokens: int) -> int:
    """How many of ``jobs`` requests arriving at once ``admitter`` admits."""
    admitted = 0
    for _ in range(jobs):
        try:
            await admitter.admit(_job(prompt_tokens=prompt_tokens, max_tokens=64))
        except APIError:
            continue
        admitted += 1
    return admitted


async def test_a_burst_between_two_snapshots_waits_behind_its_own_prompts(
    redis_url: str, model_path: str
) -> None:
    """Requests arriving at once are judged as if they had come one by one, each behind
    the prompt tokens admitted before it, not each on the idle figures of the snapshot."""
    settings = gateway_settings(redis_url, model_path)
    # An idle worker, 200 free slots, 1 ms a prompt token: 2,000 tokens fit a 2 s budget.
    idle = Capacity(workers=1, free_slots=200, slots=200, prefill_ms=50.0, prefill_ms_per_token=1.0)
    view = _View(idle)
    admitter = Admitter(settings, _Queue(Position(0, 0, 1)), view)  # type: ignore[arg-type]
    assert await _admitted(admitter, jobs=40, prompt_tokens=200) == 2_000 // 200
    # Once the figures are newer than the admissions, they are the figures' to show.
    view.current = replace(idle, reported_ms=view.clock.now_ms() + CLAIM_LAG_MS)
    assert await _admitted(admitter, jobs=1, prompt_tokens=200) == 1


async def test_a_burst_takes_the_free_slots_it_was_admitted_to(
    redis_url: str, model_path: str
) -> None:
    """Past the slots the snapshot showed free, a burst asks the queue where it stands."""
    settings = gateway_settings(redis_url, model_path)
    free = Capacity(workers=1, free_slots=4, slots=8, completed_per_s=1.0, prefill_ms=50.0)
    full = _Queue(Position(ahead=6, own_ahead=6, tenants=1, claimed=8))
    admitter = Admitter(settings, full, _View(free))  # type: ignore[arg-type]
    assert await _admitted(admitter, jobs=4, prompt_tokens=10) == 4
    assert full.asked == 0  # four free slots: no need to ask
    assert await _admitted(admitter, jobs=1, prompt_tokens=10) == 0  # 7 to finish at 1/s
    assert full.asked == 1


async def test_free_slots_come_from_the_live_leases_not_a_stale_heartbeat(
    redis_url: str, model_path: str
) -> None:
    # The heartbeat (a beat old) says all 32 slots are busy; the leases say 12 are: the
    # replies of a closed loop finished, and their clients' next requests arrive now.
    stale = Capacity(workers=1, free_slots=0, slots=32, completed_per_s=6.0, prefill_ms=80.0)
    job = _job(prompt_tokens=50, max_tokens=64)
    settings = gateway_settings(redis_url, model_path)
    live = Position(ahead=19, own_ahead=19, tenants=1, claimed=12)
    admitter = Admitter(settings, _Queue(live), _View(stale))  # type: ignore[arg-type]
    await admitter.admit(job)  # 19 ahead, 20 free: its own prefill only
    full = Position(ahead=19, own_ahead=19, tenants=1, claimed=32)
    refusing = Admitter(settings, _Queue(full), _View(stale))  # type: ignore[arg-type]
    with pytest.raises(Exception, match="exceeds the latency budget"):
        await refusing.admit(job)  # 20 to finish at 6/s: 3.4 s


@pytest.mark.parametrize(
    ("completed_per_s", "prefill_ms", "wait_ms", "retry_after"),
    # 20 to finish at 6/s plus 100 ms: 3,433.3 ms; at 10/s plus 50 ms: 2,050, floored.
    [(6.0, 100.0, 1_434, "2"), (10.0, 50.0, 100, "1")],
)
async def test_a_budget_refusal_asks_for_the_wait_until_the_estimate_fits(
    redis_url: str,
    model_path: str,
    completed_per_s: float,
    prefill_ms: float,
    wait_ms: int,
    retry_after: str,
) -> None:
    """``retry-after-ms`` is the estimate's excess over the budget (what the openai SDK
    waits), never sooner than the next capacity snapshot; ``Retry-After`` rounds it up."""
    capacity = Capacity(workers=1, slots=32, completed_per_s=completed_per_s, prefill_ms=prefill_ms)
    full = Position(ahead=19, own_ahead=19, tenants=1, claimed=32)
    settings = gateway_settings(redis_url, model_path)
    admitter = Admitter(settings, _Queue(full), _View(capacity))  # type: ignore[arg-type]
    with pytest.raises(APIError) as refused:
        await admitter.admit(_job(prompt_tokens=50, max_tokens=64))  # 20 to finish, 2 s budget
    assert refused.value.status == 429 and refused.value.headers is not None
    assert refused.value.headers["retry-after-ms"] == str(wait_ms)
    assert refused.value.headers["Retry-After"] == retry_after


def test_refusals_are_logged_a_line_a_second_per_reason() -> None:
    """A flood of refusals is one log line per reason and period, counting the rest,
    with the capacity each decision read (the estimate's inputs)."""
    job = _job(prompt_tokens=9, max_tokens=4)
    budget = Rejection(DropReason.BUDGET, "the estimated time to first token ...", 1000)
    full = Rejection(DropReason.QUEUE_FULL, "the queue is full", 1000)
    capacity = Capacity(workers=1, free_slots=3, prefill_ms=250.0)
    refusals = RefusalLog(every_s=0.2)
    with capture_logs() as logs:
        for _ in range(5):
            refusals.note(job, budget, capacity)
        refusals.note(job, full, capacity)  # another reason has its own line
        time.sleep(0.25)
        refusals.note(job, budget, capacity)
    lines = [(line["reason"], line["refused"]) for line in logs]
    assert lines == [("budget", 1), ("queue_full", 1), ("budget", 5)]
    assert logs[0]["event"] == "request refused" and logs[0]["prefill_ms"] == 250.0
    assert logs[0]["prompt_tokens"] == 9 and logs[0]["free_slots"] == 3
