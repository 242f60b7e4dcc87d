"""The autoscaling signal: the Redis queue's backlog against its deadlines, and the work
running now.

Ray Serve's default policy scales on the Serve requests a replica is handling. A charserve
replica takes no Serve requests (it claims jobs from Redis), so that number says nothing
about what users feel. What they feel is whether their request starts before its deadline,
and that is decided in the queue. Two terms, each a replica count:

- **ongoing**: jobs claimed now (every lease, on any worker) over the batch slots one
  replica offers at ``target_utilization``. Past it, an interactive request arriving now
  may find no free slot, so this term keeps headroom.
- **deadlines**: in EDF order the job at rank ``r`` starts after ``r + 1`` slots free up.
  ``N`` replicas free slots at ``N * slots / job_s`` per second (Little's law: ``job_s`` is
  the mean time a job holds a slot), so every job starts by its deadline when
  ``N >= (r + 1) / (rate per replica * time left)`` for every rank. A backfill of batch
  jobs due tomorrow asks for almost nothing; twenty interactive requests due in two
  seconds ask for as many replicas as it takes.

The desired count is the larger of the two. Serve then applies the deployment's
``min_replicas``/``max_replicas`` and ``upscale_delay_s``/``downscale_delay_s``. With
``queue_policy: fifo`` the queue's scores are arrival times, not deadlines, so the second
term falls back to plain backlog: claimed plus waiting jobs over the slots.

:class:`BacklogWatch` reads the queue and the workers' heartbeats from Redis on a daemon
thread, so the policy (called by the Serve controller every 0.1 s on its own loop) never
waits on the network. When the reading is stale (Redis unreachable), the policy holds the
current target: it never scales down blind.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Literal

import redis
import structlog
from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError

from cluster.runtime.clock import now_ms
from cluster.runtime.redis_client import connect_sync
from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import WorkerStats
from cluster.wire.vocabulary import BATCH_SCORE_OFFSET

log = structlog.get_logger(__name__)

# The queue's first ranks are read exactly, later ones at doubling ranks (64, 128, ...):
# a bounded read that still sees a deep backlog's urgency within a factor of two in rank.
EXACT_RANKS = 64
MAX_RANK = 1 << 24


class BacklogConfig(BaseModel):
    """``policy_kwargs`` of :class:`workers.scaling.policy.BacklogPolicy` (validated: a typo
    fails the deploy)."""

    model_config = ConfigDict(extra="forbid")

    redis_url: str | None = Field(
        default=None,
        description="Redis the queue lives in; `charserve deploy` fills it from the app args.",
    )
    namespace: str = Field(default="charserve", description="Key prefix (the app's).")
    queue_policy: Literal["edf", "fifo"] = Field(
        default="edf", description="The app's queue_policy; fifo scores are not deadlines."
    )
    heartbeat_ms: int = Field(
        default=1_000, ge=50, description="The app's heartbeat_ms; 3 missed = worker gone."
    )
    target_utilization: float = Field(
        default=0.75,
        gt=0,
        le=1,
        description="Share of each replica's batch slots the fleet should fill.",
    )
    job_s_prior: float = Field(
        default=10.0,
        gt=0,
        description="Mean seconds a job holds a slot, until completions measure it.",
    )
    slots_per_replica: int | None = Field(
        default=None, ge=1, description="Batch slots per replica; None = from heartbeats."
    )
    min_horizon_s: float = Field(
        default=1.0,
        gt=0,
        description="Time left assumed for a job at or past its deadline (it is urgent).",
    )
    refresh_s: float = Field(default=0.5, gt=0, description="How often Redis is read.")
    stale_s: float = Field(
        default=10.0, gt=0, description="Older readings are ignored: the target holds."
    )
    rate_window_s: float = Field(
        default=20.0, gt=0, description="Time constant of the job-duration average."
    )

    def resolved_redis_url(self) -> str:
        """The Redis URL, which the policy cannot work without."""
        if not self.redis_url:
            raise ValueError(
                "BacklogPolicy needs policy_kwargs.redis_url (charserve deploy fills it "
                "from the application's args)"
            )
        return self.redis_url


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    """The queue and the live workers at one moment."""

    now_ms: int
    waiting: int
    claimed: int
    # (rank, score) of waiting jobs in queue order: all of the first EXACT_RANKS, then
    # doubling ranks. Scores are deadlines under EDF, arrival times under FIFO (ms).
    head: tuple[tuple[int, int], ...]
    workers: int  # live and not draining
    slots: int  # batch slots of those workers
    running: int  # jobs running on those workers
    completed_per_s: float  # jobs those workers finished per second, summed


@dataclass(frozen=True, slots=True)
class Decision:
    """A desired replica count and the terms it came from (for logs and tests)."""

    replicas: float
    ongoing: float
    deadlines: float
    need_starts_per_s: float
    job_s: float
    slots_per_replica: float


def _sample_ranks(exact: int = EXACT_RANKS, limit: int = MAX_RANK) -> list[int]:
    ranks, rank = [], exact
    while rank < limit:
        ranks.append(rank)
        rank *= 2
    return ranks


_LATER_RANKS = _sample_ranks()


def read_snapshot(client: redis.Redis, keys: Keys, heartbeat_ms: int) -> QueueSnapshot:
    """Read the queue and the workers' heartbeats (two round trips)."""
    now = now_ms()
    fresh_from = now - 3 * heartbeat_ms
    ids = client.zrangebyscore(keys.workers, fresh_from, "+inf")
    pipe = client.pipeline(transaction=False)
    pipe.zcard(keys.queue)
    pipe.zcard(keys.leases)
    pipe.zrange(keys.queue, 0, EXACT_RANKS - 1, withscores=True)
    for rank in _LATER_RANKS:
        pipe.zrange(keys.queue, rank, rank, withscores=True)
    for worker_id in ids:
        name = worker_id.decode() if isinstance(worker_id, bytes) else str(worker_id)
        pipe.get(keys.worker_stats(name))
    replies = pipe.execute()
    waiting, claimed, first = int(replies[0]), int(replies[1]), replies[2]
    head = [(rank, deadline_of(score)) for rank, (_, score) in enumerate(first)]
    later = replies[3 : 3 + len(_LATER_RANKS)]
    head += [(rank, deadline_of(r[0][1])) for rank, r in zip(_LATER_RANKS, later, strict=True) if r]
    stats: list[WorkerStats] = []
    for raw in replies[3 + len(_LATER_RANKS) :]:
        if raw:
            try:
                stats.append(protocol.decode_as(raw, WorkerStats))
            except protocol.ProtocolError as exc:
                log.warning("bad worker stats", error=str(exc))
    live = [s for s in stats if not s.draining]
    return QueueSnapshot(
        now_ms=now,
        waiting=waiting,
        claimed=claimed,
        head=tuple(head),
        workers=len(live),
        slots=sum(s.max_slots for s in live),
        running=sum(s.running for s in live),
        completed_per_s=sum(s.completed_per_s for s in live),
    )


def deadline_of(score: float) -> int:
    """A waiting job's deadline from its queue score (batch jobs sort after the rest by
    :data:`~cluster.wire.vocabulary.BATCH_SCORE_OFFSET`, their deadlines unchanged)."""
    value = int(score)
    return value - BATCH_SCORE_OFFSET if value >= BATCH_SCORE_OFFSET else value


def need_starts_per_s(
    head: tuple[tuple[int, int], ...], now_ms: int, min_horizon_s: float
) -> float:
    """Job starts per second for every sampled waiting job to start by its deadline."""
    need = 0.0
    for rank, deadline_ms in head:
        left_s = max((deadline_ms - now_ms) / 1000.0, min_horizon_s)
        need = max(need, (rank + 1) / left_s)
    return need


def decide(snapshot: QueueSnapshot, job_s: float, config: BacklogConfig) -> Decision:
    """The replica count the queue and the running work ask for (not yet bounded)."""
    if config.slots_per_replica is not None:
        slots = float(config.slots_per_replica)
    elif snapshot.workers:
        slots = snapshot.slots / snapshot.workers
    else:
        slots = 1.0  # no worker to ask: one replica per job in the worst case
    usable = slots * config.target_utilization
    ongoing = snapshot.claimed / usable
    if config.queue_policy == "edf":
        need = need_starts_per_s(snapshot.head, snapshot.now_ms, config.min_horizon_s)
        starts_per_replica = slots / job_s
        deadlines = need / (starts_per_replica * config.target_utilization)
    else:
        need = 0.0
        deadlines = (snapshot.claimed + snapshot.waiting) / usable
    return Decision(
        replicas=max(ongoing, deadlines),
        ongoing=ongoing,
        deadlines=deadlines,
        need_starts_per_s=need,
        job_s=job_s,
        slots_per_replica=slots,
    )


class JobDuration:
    """Mean time a job holds a slot, from Little's law: jobs running over jobs finished
    per second, both averaged over ``window_s`` (heartbeats are one-second samples)."""

    def __init__(self, prior_s: float, window_s: float) -> None:
        self._prior_s = prior_s
        self._window_s = window_s
        self._running = 0.0
        self._completed_per_s = 0.0
        self._at_s: float | None = None
        self._seen_completion = False

    def update(self, running: int, completed_per_s: float, at_s: float) -> None:
        """Fold in one reading taken at ``at_s`` (monotonic seconds)."""
        if self._at_s is None:
            self._running, self._completed_per_s = float(running), completed_per_s
        else:
            weight = 1.0 - math.exp(-max(0.0, at_s - self._at_s) / self._window_s)
            self._running += weight * (running - self._running)
            self._completed_per_s += weight * (completed_per_s - self._completed_per_s)
        self._seen_completion = self._seen_completion or completed_per_s > 0
        self._at_s = at_s

    @property
    def seconds(self) -> float:
        """The estimate; the prior until a job has finished."""
        if not self._seen_completion or self._completed_per_s < 1e-3 or self._running < 1e-3:
            return self._prior_s
        return self._running / self._completed_per_s


@dataclass(frozen=True, slots=True)
class Reading:
    """A snapshot, the job-duration estimate at that time, and when it was taken."""

    snapshot: QueueSnapshot
    job_s: float
    taken_at_s: float


class BacklogWatch:
    """Reads :class:`QueueSnapshot` every ``refresh_s`` on a daemon thread.

    ``start()`` is idempotent; ``stop()`` ends the thread after its current read. The
    thread holds no reference to the policy that owns the watch, so a policy replaced on
    a config change can be garbage-collected (and stop its watch).
    """

    def __init__(self, config: BacklogConfig) -> None:
        self._config = config
        self._url = config.resolved_redis_url()
        self._keys = Keys(config.namespace)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reading: Reading | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start reading (once)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._run, name="charserve-backlog-watch", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop reading."""
        self._stop.set()

    def latest(self) -> Reading | None:
        """The newest reading if it is fresh enough to act on, else None."""
        with self._lock:
            reading = self._reading
        if reading is None or time.monotonic() - reading.taken_at_s > self._config.stale_s:
            return None
        return reading

    def read_once(self, client: redis.Redis, duration: JobDuration) -> Reading:
        """Take one reading now (the thread's step; also used by tests)."""
        snapshot = read_snapshot(client, self._keys, self._config.heartbeat_ms)
        taken_at_s = time.monotonic()
        duration.update(snapshot.running, snapshot.completed_per_s, taken_at_s)
        reading = Reading(snapshot, duration.seconds, taken_at_s)
        with self._lock:
            self._reading = reading
        return reading

    def _run(self) -> None:
        # Any URL form charserve takes (one server, a cluster, sentinels).
        client = connect_sync(self._url, socket_timeout=5, health_check_interval=30)
        duration = JobDuration(self._config.job_s_prior, self._config.rate_window_s)
        failing = False
        try:
            while not self._stop.is_set():
                try:
                    self.read_once(client, duration)
                    if failing:
                        log.info("backlog watch recovered")
                    failing = False
                except (RedisError, OSError) as exc:
                    if not failing:  # once per outage, not every refresh
                        log.warning("backlog watch cannot read Redis", error=str(exc))
                    failing = True
                self._stop.wait(self._config.refresh_s)
        finally:
            client.close()
