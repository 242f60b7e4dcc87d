"""The queue autoscaling policy: its arithmetic, its reading of a real Redis, and the
policy object as Ray Serve builds it (pickled by value, called with a context)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest
import redis as redis_sync
import redis.asyncio as aioredis
from ray.serve.config import AutoscalingPolicy

from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import Job, WorkerStats
from cluster.wire.queue import JobQueue
from cluster.wire.vocabulary import BATCH_SCORE_OFFSET
from workers.scaling.backlog import (
    BacklogConfig,
    BacklogWatch,
    JobDuration,
    QueueSnapshot,
    deadline_of,
    decide,
    need_starts_per_s,
    read_snapshot,
)
from workers.scaling.policy import BacklogPolicy

NOW_MS = 1_000_000_000


def snapshot(
    waiting: int = 0,
    claimed: int = 0,
    deadlines_s: list[float] | None = None,
    workers: int = 1,
    slots: int = 8,
) -> QueueSnapshot:
    head = tuple((rank, NOW_MS + int(d * 1000)) for rank, d in enumerate(deadlines_s or []))
    return QueueSnapshot(
        now_ms=NOW_MS,
        waiting=waiting,
        claimed=claimed,
        head=head,
        workers=workers,
        slots=slots * workers,
        running=claimed,
        completed_per_s=0.0,
    )


CONFIG = BacklogConfig(redis_url="redis://127.0.0.1:1/0", target_utilization=1.0)


def test_idle_asks_for_no_replica() -> None:
    assert decide(snapshot(), job_s=4.0, config=CONFIG).replicas == 0


def test_ongoing_work_asks_for_slots_at_the_target_utilisation() -> None:
    config = CONFIG.model_copy(update={"target_utilization": 0.5})
    decision = decide(snapshot(claimed=8), job_s=4.0, config=config)
    assert decision.ongoing == pytest.approx(2.0)  # 8 jobs, 4 usable slots per replica
    assert decision.deadlines == 0.0 and decision.replicas == pytest.approx(2.0)


def test_urgent_backlog_asks_for_replicas_a_full_one_does_not() -> None:
    # 8 slots, 4 s per job: one replica starts 2 jobs per second.
    urgent = snapshot(waiting=20, claimed=8, deadlines_s=[2.0] * 20)
    decision = decide(urgent, job_s=4.0, config=CONFIG)
    assert decision.need_starts_per_s == pytest.approx(10.0)  # 20 starts within 2 s
    assert decision.replicas == pytest.approx(5.0)
    # The same number of jobs due tomorrow: the replica that is there is enough.
    relaxed = snapshot(waiting=20, claimed=8, deadlines_s=[86_400.0] * 20)
    assert decide(relaxed, job_s=4.0, config=CONFIG).replicas == pytest.approx(1.0)


def test_the_tightest_rank_decides() -> None:
    # The first job has 10 s, the tenth only 2 s: ten starts in 2 s is what it takes.
    need = need_starts_per_s(
        tuple((r, NOW_MS + (10_000 if r == 0 else 2_000)) for r in range(10)), NOW_MS, 1.0
    )
    assert need == pytest.approx(5.0)


def test_a_missed_deadline_counts_as_urgent_not_infinite() -> None:
    need = need_starts_per_s(((0, NOW_MS - 5_000),), NOW_MS, min_horizon_s=0.5)
    assert need == pytest.approx(2.0)


def test_fifo_scores_are_not_deadlines_so_backlog_counts_alone() -> None:
    config = CONFIG.model_copy(update={"queue_policy": "fifo"})
    decision = decide(snapshot(waiting=12, claimed=4, deadlines_s=[0.0] * 12), 4.0, config)
    assert decision.deadlines == pytest.approx(2.0)  # (12 + 4) jobs over 8 slots
    assert decision.need_starts_per_s == 0.0


def test_without_workers_a_queued_job_still_asks_for_a_replica() -> None:
    decision = decide(snapshot(waiting=1, deadlines_s=[30.0], workers=0), 10.0, CONFIG)
    assert decision.replicas > 0


def test_job_duration_is_the_prior_until_a_job_finishes() -> None:
    duration = JobDuration(prior_s=7.0, window_s=10.0)
    duration.update(running=8, completed_per_s=0.0, at_s=0.0)
    assert duration.seconds == 7.0
    for t in range(1, 60):  # 8 jobs in flight, 2 finishing per second: 4 s each
        duration.update(running=8, completed_per_s=2.0, at_s=float(t))
    assert duration.seconds == pytest.approx(4.0, rel=0.05)


def _job(job_id: str, deadline_in_ms: int) -> Job:
    arrival = time.time_ns() // 1_000_000
    return Job(
        id=job_id,
        reply_to="inbox",
        model="m",
        prompt_token_ids=[1, 2, 3],
        max_tokens=4,
        sampling={},
        arrival_ms=arrival,
        deadline_ms=arrival + deadline_in_ms,
    )


async def _fill(
    redis_async: aioredis.Redis, keys: Keys, jobs: int, claim: int, due_in_ms: int | None = None
) -> None:
    """``jobs`` jobs (due one second apart, or all in ``due_in_ms``), ``claim`` of them
    claimed by worker w1 (4 slots, 1 job finished per second), and a draining worker w2."""
    queue = JobQueue(redis_async, keys)
    for n in range(jobs):
        await queue.enqueue(_job(f"j{n}", due_in_ms or 1_000 * (n + 1)))
    await queue.claim("w1", claim, lease_ms=10_000)
    for worker_id, draining in (("w1", False), ("w2", True)):
        stats = WorkerStats(
            worker_id=worker_id,
            max_slots=4,
            running=claim if worker_id == "w1" else 0,
            ts_ms=time.time_ns() // 1_000_000,
            draining=draining,
            completed_per_s=1.0,
        )
        await redis_async.zadd(keys.workers, {worker_id: stats.ts_ms})
        await redis_async.set(keys.worker_stats(worker_id), protocol.encode(stats))


async def test_snapshot_reads_the_queue_in_deadline_order_and_live_workers(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    await _fill(redis, keys, jobs=200, claim=3)
    client = redis_sync.Redis.from_url(redis_url)
    snap = read_snapshot(client, keys, heartbeat_ms=1_000)
    client.close()
    assert snap.waiting == 197 and snap.claimed == 3
    ranks = [rank for rank, _ in snap.head]
    assert ranks[:64] == list(range(64)) and ranks[64:] == [64, 128]  # then doubling
    deadlines = [score for _, score in snap.head]
    assert deadlines == sorted(deadlines)
    # w2 is draining: it offers no capacity.
    assert (snap.workers, snap.slots, snap.running) == (1, 4, 3)


def _ctx(target: int) -> Any:
    return SimpleNamespace(
        target_num_replicas=target, current_num_replicas=target, deployment_name="W"
    )


async def test_policy_built_like_serve_builds_it_scales_on_the_queue(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    # Ray pickles the policy class by value and builds it with policy_kwargs.
    spec = AutoscalingPolicy(
        policy_function="workers.scaling.policy:BacklogPolicy",
        policy_kwargs={
            "redis_url": redis_url,
            "namespace": keys.namespace,
            "target_utilization": 1.0,
            "job_s_prior": 4.0,
            "refresh_s": 0.05,
        },
    )
    policy_cls = spec.get_policy()
    policy = policy_cls(**spec.policy_kwargs)
    try:
        # 20 jobs wait, all due in 2 s. A replica (4 slots, 4 s per job by Little's law:
        # 4 running, 1 finishing per second) starts 1 job per second: 20 / 2 = 10.
        await _fill(redis, keys, jobs=24, claim=4, due_in_ms=2_000)
        deadline = time.monotonic() + 5
        desired: float = 1
        while desired == 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            desired, _ = policy(_ctx(1))
        assert 10 <= desired < 40  # the deadlines draw nearer while this test runs
    finally:
        assert policy._watch is not None
        policy._watch.stop()


async def test_watch_holds_when_redis_is_gone(keys: Keys) -> None:
    watch = BacklogWatch(BacklogConfig(redis_url="redis://127.0.0.1:1/0", refresh_s=0.05))
    watch.start()
    await asyncio.sleep(0.3)
    assert watch.latest() is None  # never a reading: the policy holds its target
    watch.stop()


def test_policy_without_redis_holds_instead_of_failing_in_the_controller() -> None:
    policy = BacklogPolicy(target_utilization=0.5)
    assert policy(_ctx(2)) == (2, {})


def test_policy_refuses_unknown_kwargs() -> None:
    with pytest.raises(ValueError, match="target_utilisation"):
        BacklogPolicy(redis_url="redis://127.0.0.1:1/0", target_utilisation=0.5)


def test_a_batch_jobs_queue_score_reads_back_as_its_deadline() -> None:
    # Batch jobs sort after latency-bound ones by an offset on their score; the policy
    # must see their real deadlines, or a batch backlog never asks for a replica.
    deadline = NOW_MS + 20_000
    assert deadline_of(deadline + BATCH_SCORE_OFFSET) == deadline
    assert deadline_of(deadline) == deadline
