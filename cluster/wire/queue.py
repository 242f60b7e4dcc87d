"""The work queue in Redis: earliest-deadline-first, with leases, so no accepted job is lost.

Layout (names in :mod:`cluster.wire.keys`):

- ``queue``: sorted set of waiting job ids; score = deadline (EDF) or arrival (FIFO), ms.
- ``jobs``: hash id -> encoded :class:`~cluster.wire.protocol.Job`, for waiting and claimed jobs.
- ``leases``: sorted set of claimed ids; score = lease expiry in Redis server time (ms).
- ``owners``: hash id -> worker id holding the lease.
- ``batch``: set of the batch-class ids among them. A worker caps how many batch jobs it
  runs (headroom for interactive work); when the job at the head of the queue is a batch
  job and the worker has no batch room left, the claim stops there.
- ``wake``: a short list that idle workers ``BLPOP``; every enqueue pushes one token, so an
  idle worker wakes within a network round trip of an enqueue instead of polling.
- ``dead``: capped list of dead-lettered jobs.

A lease that is not renewed expires; any live worker then *reclaims* the job (taking the
lease itself, so two workers cannot both requeue it), decides whether to requeue it with
attempt+1 or dead-letter it, and does so atomically only while it still holds that lease.

Every state change is one Lua script, so a worker that dies between two commands cannot
leave a job half-claimed. Lease times use Redis's own clock, so workers on other machines
with skewed clocks agree on expiry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import redis.asyncio as aioredis

from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import Job
from cluster.wire.vocabulary import PriorityClass

QueuePolicy = Literal["edf", "fifo"]
CancelOutcome = Literal["dequeued", "signalled", "unknown"]

# Wake tokens beyond this many are pointless: there are never that many idle workers.
_WAKE_CAP = 64
_DEAD_CAP = 10_000

_ENQUEUE = """
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[3]) == 0 then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
if ARGV[5] == '1' then redis.call('SADD', KEYS[4], ARGV[1]) end
if ARGV[6] ~= '' then redis.call('SET', KEYS[5], ARGV[6], 'PX', ARGV[7]) end
if ARGV[8] == '' then
  redis.call('LPUSH', KEYS[3], '1')
  redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[4]) - 1)
else
  -- Only the preferred worker can take it now: wake that one.
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('HSET', KEYS[6], ARGV[1], ARGV[8] .. '|' .. (now + tonumber(ARGV[9])))
  redis.call('LPUSH', KEYS[7], '1')
  redis.call('LTRIM', KEYS[7], 0, tonumber(ARGV[4]) - 1)
  redis.call('PEXPIRE', KEYS[7], 60000)
end
return 1
"""

# Lease times come from Redis's own clock, so workers with skewed clocks agree on expiry.
# Shared by every Lua script that needs the time (the queue's and the batch store's).
NOW_MS_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

_CLAIM = (
    NOW_MS_LUA
    + """
local expiry = now + tonumber(ARGV[3])
local want = tonumber(ARGV[2])
local batch_room = tonumber(ARGV[4])
local out = {}
local taken = 0
-- Scan the head of the queue in order. A job that prefers another worker (session
-- affinity) is left for it until its preference lapses; everything else runs in order.
local head = redis.call('ZRANGE', KEYS[1], 0, want + 31)
for _, id in ipairs(head) do
  if taken >= want then break end
  local mine = true
  local pref = redis.call('HGET', KEYS[6], id)
  if pref then
    local sep = string.find(pref, '|', 1, true)
    if string.sub(pref, 1, sep - 1) ~= ARGV[1] and now < tonumber(string.sub(pref, sep + 1)) then
      mine = false
    end
  end
  local is_batch = redis.call('SISMEMBER', KEYS[5], id) == 1
  if mine and is_batch and batch_room <= 0 then break end
  local body = nil
  if mine then
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[6], id)
    body = redis.call('HGET', KEYS[2], id)
  end
  if body then
    if is_batch then batch_room = batch_room - 1 end
    redis.call('ZADD', KEYS[3], expiry, id)
    redis.call('HSET', KEYS[4], id, ARGV[1])
    out[#out + 1] = id
    out[#out + 1] = body
    taken = taken + 1
  end
end
return out
"""
)

_ACK = """
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('SREM', KEYS[4], ARGV[1])
return 1
"""

_RECLAIM = (
    NOW_MS_LUA
    + """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[3]))
local out = {}
for _, id in ipairs(ids) do
  local body = redis.call('HGET', KEYS[3], id)
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), id)
  redis.call('HSET', KEYS[2], id, ARGV[1])
  out[#out + 1] = id
  out[#out + 1] = body or ''
end
return out
"""
)

_REQUEUE = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[1])
redis.call('LPUSH', KEYS[5], '1')
redis.call('LTRIM', KEYS[5], 0, tonumber(ARGV[5]) - 1)
return 1
"""

_DEAD_LETTER = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('SREM', KEYS[5], ARGV[1])
redis.call('LPUSH', KEYS[4], ARGV[3])
redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[4]) - 1)
return 1
"""

_RENEW = (
    NOW_MS_LUA
    + """
local expiry = now + tonumber(ARGV[2])
local lost = {}
for i = 3, #ARGV do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[1] then
    redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i])
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""
)

_CANCEL = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('SREM', KEYS[4], ARGV[1])
  redis.call('HDEL', KEYS[5], ARGV[1])
  return 'dequeued'
end
local owner = redis.call('HGET', KEYS[3], ARGV[1])
if owner then
  redis.call('PUBLISH', ARGV[2] .. owner, ARGV[3])
  return 'signalled'
end
return 'unknown'
"""


@dataclass(frozen=True, slots=True)
class QueueStats:
    """A snapshot of the queue."""

    waiting: int
    claimed: int


@dataclass(frozen=True, slots=True)
class Poison:
    """A leased job whose body does not decode: it can only be dead-lettered."""

    id: str
    body: bytes
    error: str


def _decode_pairs(flat: list[bytes]) -> list[Job | Poison]:
    out: list[Job | Poison] = []
    for raw_id, body in zip(flat[::2], flat[1::2], strict=True):
        job_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
        try:
            job = protocol.decode_as(body, Job)
        except protocol.ProtocolError as exc:
            out.append(Poison(job_id, body, str(exc)))
            continue
        out.append(job)
    return out


class JobQueue:
    """Enqueue, claim, ack, renew and cancel jobs. One instance per process is enough; it
    holds no state beyond its Redis client and registered scripts."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, policy: QueuePolicy = "edf") -> None:
        self._redis = redis
        self._keys = keys
        self.policy: QueuePolicy = policy
        self._enqueue = redis.register_script(_ENQUEUE)
        self._claim = redis.register_script(_CLAIM)
        self._ack = redis.register_script(_ACK)
        self._renew = redis.register_script(_RENEW)
        self._cancel = redis.register_script(_CANCEL)
        self._reclaim = redis.register_script(_RECLAIM)
        self._requeue = redis.register_script(_REQUEUE)
        self._dead_letter = redis.register_script(_DEAD_LETTER)

    def score(self, job: Job) -> int:
        """Queue order: deadline for EDF, arrival for FIFO (lower runs first)."""
        return job.deadline_ms if self.policy == "edf" else job.arrival_ms

    async def enqueue(
        self,
        job: Job,
        meta: bytes = b"",
        meta_ttl_ms: int = 3_600_000,
        prefer: str | None = None,
        prefer_ms: int = 500,
    ) -> bool:
        """Queue ``job`` and wake one idle worker. False if its id is already queued.

        ``meta`` (who asked, and how to render the reply) is stored beside the job's reply
        log in the same round trip, for resuming and for checking who may read it.
        ``prefer`` names a worker that should run it (its prefix cache holds the
        conversation): other workers leave the job for ``prefer_ms``, and that worker is
        woken directly.
        """
        k = self._keys
        is_batch = "1" if job.priority_class == PriorityClass.BATCH else "0"
        added = await self._enqueue(
            keys=[
                k.queue,
                k.jobs,
                k.wake,
                k.batch_jobs,
                k.request_meta(job.id),
                k.prefer,
                k.wake_for(prefer or ""),
            ],
            args=[
                job.id,
                self.score(job),
                protocol.encode(job),
                _WAKE_CAP,
                is_batch,
                meta,
                meta_ttl_ms,
                prefer or "",
                prefer_ms,
            ],
        )
        return bool(added)

    async def claim(
        self, worker_id: str, max_jobs: int, lease_ms: int, batch_room: int | None = None
    ) -> list[Job | Poison]:
        """Atomically take up to ``max_jobs`` jobs in queue order and lease them, at most
        ``batch_room`` of them batch jobs (None: no cap).

        A body that does not decode comes back as :class:`Poison` (still leased), so the
        caller can dead-letter it instead of letting it block the queue.
        """
        if max_jobs <= 0:
            return []
        k = self._keys
        room = max_jobs if batch_room is None else max(0, batch_room)
        bodies = await self._claim(
            keys=[k.queue, k.jobs, k.leases, k.owners, k.batch_jobs, k.prefer],
            args=[worker_id, max_jobs, lease_ms, room],
        )
        return _decode_pairs(bodies)

    async def reclaim_expired(
        self, worker_id: str, lease_ms: int, limit: int = 100
    ) -> list[Job | Poison]:
        """Take over jobs whose lease expired (their worker died or hung).

        The caller now holds their leases and must :meth:`requeue` or :meth:`dead_letter`
        each one (or :meth:`ack` it when it turns out to have finished).
        """
        k = self._keys
        bodies = await self._reclaim(
            keys=[k.leases, k.owners, k.jobs], args=[worker_id, lease_ms, limit]
        )
        return _decode_pairs(bodies)

    async def requeue(self, job: Job, worker_id: str) -> bool:
        """Put a job we hold the lease of back in the queue (with its new body)."""
        k = self._keys
        done = await self._requeue(
            keys=[k.leases, k.owners, k.jobs, k.queue, k.wake],
            args=[job.id, worker_id, protocol.encode(job), self.score(job), _WAKE_CAP],
        )
        return bool(done)

    async def dead_letter(self, job_id: str, body: bytes, worker_id: str) -> bool:
        """Move a job we hold the lease of to the dead-letter list."""
        k = self._keys
        done = await self._dead_letter(
            keys=[k.leases, k.owners, k.jobs, k.dead, k.batch_jobs],
            args=[job_id, worker_id, body, _DEAD_CAP],
        )
        return bool(done)

    async def wait_for_work(
        self, redis: aioredis.Redis, timeout_s: float, worker_id: str = ""
    ) -> bool:
        """Block on the wake lists (this worker's own, then the shared one) until an
        enqueue (True) or the timeout (False).

        ``redis`` must be a client whose connection may block (a dedicated one).
        """
        lists = (
            [self._keys.wake_for(worker_id), self._keys.wake] if worker_id else [self._keys.wake]
        )
        got = await redis.blpop(lists, timeout=timeout_s)
        return got is not None

    async def ack(self, job_id: str, worker_id: str) -> bool:
        """Finish a job: drop its body and lease. False if the lease was no longer ours."""
        k = self._keys
        done = await self._ack(
            keys=[k.leases, k.jobs, k.owners, k.batch_jobs], args=[job_id, worker_id]
        )
        return bool(done)

    async def renew(self, worker_id: str, job_ids: list[str], lease_ms: int) -> list[str]:
        """Extend our leases; return the ids whose lease is no longer ours."""
        if not job_ids:
            return []
        k = self._keys
        lost = await self._renew(keys=[k.leases, k.owners], args=[worker_id, lease_ms, *job_ids])
        return [x.decode() if isinstance(x, bytes) else str(x) for x in lost]

    async def cancel(self, job_id: str, reason: str = "client_disconnected") -> CancelOutcome:
        """Remove a waiting job, or tell the worker running it to abort."""
        k = self._keys
        message = protocol.encode(protocol.Cancel(request_id=job_id, reason=reason))
        outcome = await self._cancel(
            keys=[k.queue, k.jobs, k.owners, k.batch_jobs, k.prefer],
            args=[job_id, k.control(""), message],
        )
        text = outcome.decode() if isinstance(outcome, bytes) else str(outcome)
        return text  # type: ignore[return-value]

    async def ahead_of(self, job_score: int) -> int:
        """How many waiting jobs run before one with this score."""
        return int(await self._redis.zcount(self._keys.queue, "-inf", job_score))

    async def stats(self) -> QueueStats:
        """How many jobs wait and how many are claimed."""
        k = self._keys
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zcard(k.queue)
            pipe.zcard(k.leases)
            waiting, claimed = await pipe.execute()
        return QueueStats(waiting=int(waiting), claimed=int(claimed))
