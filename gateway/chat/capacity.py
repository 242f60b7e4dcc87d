"""What the gateway knows of the workers' capacity: a snapshot refreshed in the background.

Admission must not add Redis round trips to every request's time to first token, so a
task reads the workers' heartbeats and the queue depth every ``refresh_ms`` and keeps the
result; a request only asks Redis how much work is ahead of it when the snapshot says it
may have to wait at all.

A refresh is one read-only script call (Redis's clock, the fresh workers' stats, the queue
depth), not a lookup of the worker ids followed by a pipeline: the refresh runs ten times a
second in every gateway process, busy or idle, on the core the engine's scheduler shares.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from cluster.runtime.clock import RedisClock
from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import WorkerStats
from cluster.wire.queue import NOW_MS_LUA

log = structlog.get_logger(__name__)

# KEYS: 1 the workers' heartbeat set, 2 the queue. ARGV: 1 how recent a heartbeat must be
# (ms, by Redis's clock), 2 the worker-stats key prefix. Returns {Redis's time (ms), queued
# jobs, then the stats of each fresh worker (nil if it expired meanwhile)}.
_SNAPSHOT = (
    "#!lua flags=no-writes\n"
    + NOW_MS_LUA
    + """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], now - tonumber(ARGV[1]), '+inf')
local out = {now, redis.call('ZCARD', KEYS[2])}
for _, id in ipairs(ids) do
  out[#out + 1] = redis.call('GET', ARGV[2] .. id) or false
end
return out
"""
)


@dataclass(frozen=True, slots=True)
class Capacity:
    """One snapshot of the cluster's serving capacity."""

    workers: int = 0
    free_slots: int = 0
    slots: int = 0
    completed_per_s: float = 0.0
    prefill_ms: float = 0.0
    prefill_ms_per_token: float = 0.0
    prefill_queued_ms: float = 0.0
    waiting: int = 0
    taken_at_s: float = 0.0
    # Free slots of each live (not draining) worker, for session affinity.
    free_by_worker: dict[str, int] = field(default_factory=dict)
    # False when a live worker cannot honour a seed (any worker may claim a job).
    honours_seed: bool = True
    # The LoRA adapters some live worker has loaded (a request may name one as its model).
    adapters: frozenset[str] = frozenset()
    # Redis's time (ms) by which every live worker's figures were taken: a job admitted
    # before it and claimed at once is in them (0: no worker).
    reported_ms: int = 0


def summarize(stats: list[WorkerStats], waiting: int, now_s: float) -> Capacity:
    """Fold live workers' heartbeats into one snapshot (draining workers take no work)."""
    live = [s for s in stats if not s.draining]
    prefill = [s.prefill_ms for s in live if s.prefill_ms > 0]
    per_token = [s.prefill_ms_per_token for s in live if s.prefill_ms_per_token > 0]
    return Capacity(
        workers=len(live),
        free_slots=sum(s.free_slots for s in live),
        slots=sum(s.max_slots for s in live),
        completed_per_s=sum(s.completed_per_s for s in live),
        prefill_ms=max(prefill) if prefill else 0.0,
        prefill_ms_per_token=max(per_token) if per_token else 0.0,
        prefill_queued_ms=max((s.prefill_queued_ms for s in live), default=0.0),
        waiting=waiting,
        taken_at_s=now_s,
        free_by_worker={s.worker_id: s.free_slots for s in live},
        honours_seed=all(s.honours_seed for s in live),
        adapters=frozenset(a for s in live for a in s.adapters),
        reported_ms=min((max(s.at_ms, s.ts_ms) for s in live), default=0),
    )


class CapacityView:
    """Owns the refresh task; :attr:`current` is the latest snapshot."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        heartbeat_ms: int,
        refresh_ms: int = 100,
        clock: RedisClock | None = None,
    ) -> None:
        self._keys = keys
        self._snapshot = redis.register_script(_SNAPSHOT)
        self.clock = clock or RedisClock()
        self._fresh_ms = 3 * heartbeat_ms
        self.refresh_ms = refresh_ms
        self._refresh_s = refresh_ms / 1000.0
        self.current = Capacity()
        self._stop = asyncio.Event()
        self._sleeping = False
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Take a first snapshot, then keep refreshing."""
        await self._refresh_safely()
        self._task = asyncio.create_task(self._run(), name="capacity")

    async def close(self) -> None:
        """Stop refreshing (between two refreshes: cancelling a Redis command midway can
        leave its connection unusable for the client's own close)."""
        self._stop.set()
        if self._task is not None:
            if self._sleeping:
                self._task.cancel()
            await self._task

    async def _run(self) -> None:
        # A plain sleep, not a wait_for on the stop event (a task and a timer per tick):
        # close() cancels the sleep, never a refresh.
        while not self._stop.is_set():
            self._sleeping = True
            try:
                await asyncio.sleep(self._refresh_s)
            except asyncio.CancelledError:
                return
            finally:
                self._sleeping = False
            if not self._stop.is_set():
                await self._refresh_safely()

    async def _refresh_safely(self) -> None:
        try:
            self.current = await self.refresh()
        except (RedisError, protocol.ProtocolError) as exc:
            log.warning("capacity refresh failed", error=str(exc))

    async def refresh(self) -> Capacity:
        """Read heartbeats and queue depth now (and Redis's clock, which every deadline
        and freshness judgement of this process follows), in one round trip."""
        now_ms, waiting, *raw = await self._snapshot(
            keys=[self._keys.workers, self._keys.queue],
            args=[self._fresh_ms, self._keys.worker_stats_prefix],
        )
        self.clock.observe(int(now_ms))
        stats = [protocol.decode_as(r, WorkerStats) for r in raw if r]
        return summarize(stats, int(waiting), time.monotonic())
