"""The work queue in Redis: earliest deadline first across classes, a fair share between
tenants within a class, and leases, so no accepted job is lost.

Layout (names in :mod:`cluster.wire.keys`):

- ``queue``: sorted set of every waiting job id. Score = deadline (EDF) or arrival (FIFO),
  in ms, plus :data:`~cluster.wire.vocabulary.BATCH_SCORE_OFFSET` for batch jobs, so no
  batch job, whatever budget its client asked for, sorts ahead of latency-bound work.
- ``tq:{class}:{tenant}``: the same ids, one sorted set per tenant and class.
- ``backlogged:{class}``: the tenants with waiting jobs in a class, score = their virtual
  time (``vtime:{class}``: tokens served in that class over the tenant's weight).
- ``jobs``: id -> encoded :class:`~cluster.wire.protocol.Job`; ``jobinfo``: id -> what the
  scripts need without decoding a body (tenant, class, weight, bytes, flags, the tenant's
  cap on running jobs, its gateway, the prompt's tokens).
- ``tenant-waiting``, ``tenant-bytes``, ``tenant-running``: per-tenant counts, for caps.
- ``leases``: claimed ids, score = lease expiry in Redis time; ``owners``: id -> worker.
- ``batch``: the batch-class ids among waiting and claimed jobs (a worker caps how many it
  runs: headroom for interactive work).
- ``wake``: a short list idle workers ``BLPOP``, one token per enqueue; a claim that
  leaves nothing waiting clears the lists its worker blocks on (their tokens are stale).
- ``cancelled``: cancelled ids with the time their record expires: a cancel is honoured
  when the job is claimed, reclaimed or requeued, whenever it arrived.
- ``dead``: the dead-letter list, capped by count and by bytes.

**The claim.** The head of ``queue`` says which class is most urgent; within that class
the job goes to the backlogged tenant with the least virtual time (weighted fair queuing
by tokens served, as in the Virtual Token Counter of Sheng et al., OSDI 2024), its
earliest deadline first. A tenant that starts waiting joins at the least virtual time of
those already waiting, so idle time banks no credit. A claim charges the prompt's tokens,
an ack the reply's. So a tenant's flood lengthens its own wait, not other tenants'. A
tenant at its cap of running jobs is passed over; a non-resumable job whose gateway is
gone (its liveness key expired) is dropped: nobody would read its reply.

A lease that is not renewed expires; any live worker then *reclaims* the job (taking the
lease itself, so two workers cannot both requeue it), decides whether to requeue it with
attempt+1 or dead-letter it, and does so atomically only while it still holds that lease.

**LoRA adapters.** A job whose model is not the base model names a LoRA adapter (vLLM's
convention: an adapter is served under its own model name); its info records it, and only
a worker that says it serves that adapter claims it (the others pass over it, within the
claim's bounded scan). Such a job wakes the adapter's own wake list, which only the
workers serving it block on. The gateway refuses an adapter no live worker advertises, so
nothing waits for a worker that does not exist.

Every state change is one Lua script, so a worker that dies between two commands cannot
leave a job half-claimed. Scripts that write declare it (``#!lua``), so a Redis over its
``maxmemory`` refuses them whole before they run: nothing is ever half-written. Times are
Redis's own clock (``TIME``), so processes on machines with skewed clocks agree.
"""

from __future__ import annotations

from collections.abc import Awaitable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import Job
from cluster.wire.turns import Call, TurnBatch
from cluster.wire.vocabulary import BATCH_SCORE_OFFSET, PriorityClass

QueuePolicy = Literal["edf", "fifo"]
CancelOutcome = Literal["dequeued", "signalled", "recorded"]
EnqueueStatus = Literal[
    "queued", "duplicate", "attached", "conflict", "queue_full", "tenant_queue_full",
    "tenant_bytes_full",
]  # fmt: skip

# Wake tokens beyond this many are pointless: there are never that many idle workers.
_WAKE_CAP = 64
_DEAD_CAP = 10_000
DEAD_MAX_BYTES = 64 * 1024 * 1024
# How long a cancel is remembered (a job is claimed, reclaimed or requeued within it).
CANCEL_RECORD_MS = 3_600_000
# The classes, in the order of the per-class keys the scripts take.
_CLASSES = (PriorityClass.INTERACTIVE, PriorityClass.STANDARD, PriorityClass.BATCH)

# The first line of a script that only moves or frees what is already stored, or replaces
# a record of bounded size: Redis runs it past its ``maxmemory`` too (see :func:`_script`).
ALLOW_OOM = "#!lua flags=allow-oom\n"

# Lease and record times come from Redis's own clock, so processes with skewed clocks
# agree. Shared by every Lua script that needs the time (the queue's and the batch store's).
NOW_MS_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# Shared by the scripts: Redis's clock, a job's info record, and the per-tenant structures.
# Expects local ``INFO`` (the jobinfo key), ``TQ`` (the tenant-queue key prefix),
# ``WAITING``, ``BYTES``, ``RUNNING`` (the per-tenant count hashes), ``BACKLOGGED`` and
# ``VTIME`` (tables from class name to key) to be set first.
_PRELUDE = (
    NOW_MS_LUA
    + """
-- jobinfo: tenant|class|weight|bytes|flags|max_running|gateway|cost|adapter
local function parse(raw)
  local f, start = {}, 1
  while true do
    local sep = string.find(raw, '|', start, true)
    if not sep then f[#f + 1] = string.sub(raw, start); break end
    f[#f + 1] = string.sub(raw, start, sep - 1)
    start = sep + 1
  end
  return {tenant = f[1], class = f[2], weight = tonumber(f[3]), bytes = tonumber(f[4]),
          flags = f[5], max_running = tonumber(f[6]), gateway = f[7], cost = tonumber(f[8]),
          adapter = f[9] or ''}
end

local function info(id)
  local raw = redis.call('HGET', INFO, id)
  if raw then return parse(raw) end
  return nil
end

local function add(hash, field, by)
  if redis.call('HINCRBY', hash, field, by) <= 0 then redis.call('HDEL', hash, field) end
end

-- A tenant that starts waiting joins at the least virtual time of those waiting.
local function backlog(f)
  local bkey = BACKLOGGED[f.class]
  if redis.call('ZSCORE', bkey, f.tenant) then return end
  local v = tonumber(redis.call('HGET', VTIME[f.class], f.tenant) or '0')
  local least = redis.call('ZRANGE', bkey, 0, 0, 'WITHSCORES')
  if least[2] and tonumber(least[2]) > v then v = tonumber(least[2]) end
  redis.call('HSET', VTIME[f.class], f.tenant, v)
  redis.call('ZADD', bkey, v, f.tenant)
end

-- Charge ``tokens`` served to a tenant's virtual time.
local function charge(f, tokens)
  if tokens <= 0 then return end
  local v = redis.call('HINCRBYFLOAT', VTIME[f.class], f.tenant, tokens / f.weight)
  if redis.call('ZSCORE', BACKLOGGED[f.class], f.tenant) then
    redis.call('ZADD', BACKLOGGED[f.class], v, f.tenant)
  end
end

local function waiting_add(id, score, f)
  redis.call('ZADD', QUEUE, score, id)
  redis.call('ZADD', TQ .. f.class .. ':' .. f.tenant, score, id)
  add(WAITING, f.tenant, 1)
  add(BYTES, f.tenant, f.bytes)
  backlog(f)
end

local function waiting_remove(id, f)
  redis.call('ZREM', QUEUE, id)
  local tq = TQ .. f.class .. ':' .. f.tenant
  redis.call('ZREM', tq, id)
  add(WAITING, f.tenant, -1)
  add(BYTES, f.tenant, -f.bytes)
  if redis.call('ZCARD', tq) == 0 then redis.call('ZREM', BACKLOGGED[f.class], f.tenant) end
end

-- A waiting job leaves the queue and is forgotten (``f``: its info, if already read).
local function unqueue(id, f)
  f = f or info(id)
  if f then waiting_remove(id, f) else redis.call('ZREM', QUEUE, id) end
  redis.call('HDEL', JOBS, id)
  redis.call('HDEL', INFO, id)
  redis.call('HDEL', PREFER, id)
  redis.call('SREM', BATCH, id)
end
"""
)


def _script(keys: str, body: str, *, frees: bool = False) -> str:
    """A script: the shebang, the key names it binds, the prelude, then ``body``.

    A Redis over its ``maxmemory`` (``noeviction``) refuses a script that may write
    whole, before it runs: nothing is half-written. Scripts that only move or free what is
    already stored (``frees``: claim, ack, renew, cancel, recovery) run anyway, so work
    already accepted finishes while new work is refused."""
    shebang = ALLOW_OOM if frees else "#!lua\n"
    return shebang + keys + _PRELUDE + body


# Every script binds the same names to its KEYS, in this order, then its own keys after.
_COMMON_KEYS = """
local QUEUE, JOBS, INFO = KEYS[1], KEYS[2], KEYS[3]
local WAITING, BYTES, RUNNING = KEYS[4], KEYS[5], KEYS[6]
local LEASES, OWNERS, BATCH, PREFER, CANCELLED = KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11]
local BACKLOGGED = {interactive = KEYS[12], standard = KEYS[13], batch = KEYS[14]}
local VTIME = {interactive = KEYS[15], standard = KEYS[16], batch = KEYS[17]}
local TQ = ARGV[1]
"""
_N_COMMON = 17

_ENQUEUE = _script(
    _COMMON_KEYS,
    """
-- KEYS[18] wake, [19] the preferred worker's wake list, [20] meta, [21] idempotency key,
-- [22] the wake list of the job's adapter (used when it names one)
-- ARGV: 2 id, 3 score, 4 body, 5 info, 6 meta, 7 meta_ttl_ms, 8 prefer, 9 prefer_ms,
-- 10 wake cap, 11 max waiting in all, 12 tenant's max waiting, 13 tenant's max bytes,
-- 14 idempotency value ('' none), 15 its TTL (ms)
local id = ARGV[2]
if redis.call('HEXISTS', JOBS, id) == 1 then return {'duplicate', id} end
if ARGV[14] ~= '' then
  local held = redis.call('GET', KEYS[21])
  if held then
    local sep = string.find(held, '|', 1, true)
    local mine = string.sub(ARGV[14], string.find(ARGV[14], '|', 1, true) + 1)
    if string.sub(held, sep + 1) ~= mine then return {'conflict', string.sub(held, 1, sep - 1)} end
    return {'attached', string.sub(held, 1, sep - 1)}
  end
end
local f = parse(ARGV[5])
local cap = tonumber(ARGV[11])
if cap > 0 and redis.call('ZCARD', QUEUE) >= cap then return {'queue_full', id} end
cap = tonumber(ARGV[12])
if cap > 0 and tonumber(redis.call('HGET', WAITING, f.tenant) or '0') >= cap then
  return {'tenant_queue_full', id}
end
cap = tonumber(ARGV[13])
if cap > 0 and tonumber(redis.call('HGET', BYTES, f.tenant) or '0') + f.bytes > cap then
  return {'tenant_bytes_full', id}
end
redis.call('HSET', INFO, id, ARGV[5])
redis.call('HSET', JOBS, id, ARGV[4])
waiting_add(id, ARGV[3], f)
if f.class == 'batch' then redis.call('SADD', BATCH, id) end
if ARGV[6] ~= '' then redis.call('SET', KEYS[20], ARGV[6], 'PX', ARGV[7]) end
if ARGV[14] ~= '' then redis.call('SET', KEYS[21], ARGV[14], 'PX', ARGV[15]) end
if ARGV[8] == '' and f.adapter ~= '' then
  -- Only the workers serving its adapter can take it: wake one of them.
  redis.call('LPUSH', KEYS[22], '1')
  redis.call('LTRIM', KEYS[22], 0, tonumber(ARGV[10]) - 1)
  redis.call('PEXPIRE', KEYS[22], 60000)
elseif ARGV[8] == '' then
  redis.call('LPUSH', KEYS[18], '1')
  redis.call('LTRIM', KEYS[18], 0, tonumber(ARGV[10]) - 1)
else
  -- Only the preferred worker can take it now: wake that one.
  redis.call('HSET', PREFER, id, ARGV[8] .. '|' .. (now + tonumber(ARGV[9])))
  redis.call('LPUSH', KEYS[19], '1')
  redis.call('LTRIM', KEYS[19], 0, tonumber(ARGV[10]) - 1)
  redis.call('PEXPIRE', KEYS[19], 60000)
end
return {'queued', id}
""",
)

_CLAIM = _script(
    _COMMON_KEYS,
    """
-- KEYS[18..] the wake lists this worker blocks on (shared, its own, its adapters').
-- ARGV: 2 worker, 3 want, 4 lease_ms, 5 batch room, 6 the gateway-alive key prefix,
-- 7.. the LoRA adapters this worker serves. Returns {now, drained, id, body, id, body,
-- ...}: drained is 1 when nothing is left waiting after this claim.
local worker, want = ARGV[2], tonumber(ARGV[3])
local serves = {}
for i = 7, #ARGV do serves[ARGV[i]] = true end
local expiry = now + tonumber(ARGV[4])
local batch_room = tonumber(ARGV[5])
local out = {now, 0}
local taken = 0

local function mine(id)
  local pref = redis.call('HGET', PREFER, id)
  if not pref then return true end
  local sep = string.find(pref, '|', 1, true)
  return string.sub(pref, 1, sep - 1) == worker or now >= tonumber(string.sub(pref, sep + 1))
end

local function gone(f)
  -- A job that cannot be resumed, whose gateway stopped: nobody will read its reply.
  return string.find(f.flags, 'r', 1, true) == nil and f.gateway ~= ''
    and redis.call('EXISTS', ARGV[6] .. f.gateway) == 0
end

local function take(id, f)
  waiting_remove(id, f)
  redis.call('HDEL', PREFER, id)
  redis.call('ZADD', LEASES, expiry, id)
  redis.call('HSET', OWNERS, id, worker)
  add(RUNNING, f.tenant, 1)
  charge(f, f.cost)
  out[#out + 1] = id
  out[#out + 1] = redis.call('HGET', JOBS, id)
  taken = taken + 1
end

-- The next job of a class: its least-served tenant's most urgent job this worker may take.
local function next_of(class)
  local tenants = redis.call('ZRANGE', BACKLOGGED[class], 0, 31)
  for _, tenant in ipairs(tenants) do
    local running = tonumber(redis.call('HGET', RUNNING, tenant) or '0')
    local tq = TQ .. class .. ':' .. tenant
    for _, id in ipairs(redis.call('ZRANGE', tq, 0, 7)) do
      local f = info(id)
      if not f then
        redis.call('ZREM', tq, id)  -- a stale entry
      elseif gone(f) then
        unqueue(id, f)
      elseif f.max_running > 0 and running >= f.max_running then
        break  -- this tenant is at its cap: the next tenant
      elseif f.adapter ~= '' and not serves[f.adapter] then
        -- An adapter this worker has not loaded: left for a worker that has.
      elseif mine(id) then
        return id, f
      end
    end
  end
  return nil, nil
end

local exhausted = {}
for _, head in ipairs(redis.call('ZRANGE', QUEUE, 0, want + 63)) do
  if taken >= want then break end
  local hf = info(head)
  if not hf then
    -- No record (a job an older build queued, or a body from nowhere): lease it as it is,
    -- so the worker decodes it, or dead-letters it, rather than leave it at the head.
    redis.call('ZREM', QUEUE, head)
    redis.call('ZADD', LEASES, expiry, head)
    redis.call('HSET', OWNERS, head, worker)
    out[#out + 1] = head
    out[#out + 1] = redis.call('HGET', JOBS, head) or ''
    taken = taken + 1
  elseif not exhausted[hf.class] then
    -- Batch sorts after everything else: no room for it ends the claim.
    if hf.class == 'batch' and batch_room <= 0 then break end
    local id, f = next_of(hf.class)
    if id then
      take(id, f)
      if f.class == 'batch' then batch_room = batch_room - 1 end
    else
      exhausted[hf.class] = true
    end
  end
end
-- Nothing left waiting: every wake token is stale (an enqueue pushes a fresh one), and
-- each would only send this worker round an empty claim again (a group of 31 enqueues
-- left about 30 of them).
if redis.call('ZCARD', QUEUE) == 0 then
  for i = 18, #KEYS do redis.call('DEL', KEYS[i]) end
  out[2] = 1
end
return out
""",
    frees=True,
)

_ACK = _script(
    _COMMON_KEYS,
    """
-- ARGV: 2 worker, then (id, tokens generated) pairs. Returns one 1 per pair, or 0 where
-- the lease is not ours (that job is left as it is).
local me, done = ARGV[2], {}
for j = 3, #ARGV, 2 do
  local id = ARGV[j]
  if redis.call('HGET', OWNERS, id) ~= me then
    done[#done + 1] = 0
  else
    local f = info(id)
    if f then
      add(RUNNING, f.tenant, -1)
      charge(f, tonumber(ARGV[j + 1]))
    end
    redis.call('ZREM', LEASES, id)
    redis.call('HDEL', JOBS, id)
    redis.call('HDEL', OWNERS, id)
    redis.call('HDEL', INFO, id)
    redis.call('SREM', BATCH, id)
    redis.call('ZREM', CANCELLED, id)
    done[#done + 1] = 1
  end
end
return done
""",
    frees=True,
)

_RECLAIM = _script(
    _COMMON_KEYS,
    """
-- ARGV: 2 worker, 3 lease_ms, 4 limit. Takes the leases that expired; {id, body, ...}.
local ids = redis.call('ZRANGEBYSCORE', LEASES, '-inf', now, 'LIMIT', 0, tonumber(ARGV[4]))
local out = {}
for _, id in ipairs(ids) do
  redis.call('ZADD', LEASES, now + tonumber(ARGV[3]), id)
  redis.call('HSET', OWNERS, id, ARGV[2])
  out[#out + 1] = id
  out[#out + 1] = redis.call('HGET', JOBS, id) or ''
end
return out
""",
    frees=True,
)

_REQUEUE = _script(
    _COMMON_KEYS,
    """
-- KEYS[18] wake. ARGV: 2 id, 3 worker, 4 body, 5 score, 6 wake cap, 7 the adapter wake
-- list prefix.
-- Returns 1 (queued again), 0 (the lease is not ours), -1 (cancelled: dropped instead).
local id = ARGV[2]
if redis.call('HGET', OWNERS, id) ~= ARGV[3] then return 0 end
local f = info(id)
redis.call('ZREM', LEASES, id)
redis.call('HDEL', OWNERS, id)
if f then add(RUNNING, f.tenant, -1) end
local record = redis.call('ZSCORE', CANCELLED, id)
if (not f) or (record and tonumber(record) > now) then
  redis.call('HDEL', JOBS, id)
  redis.call('HDEL', INFO, id)
  redis.call('SREM', BATCH, id)
  return -1
end
-- The body changed (what was delivered is in it): its size is the one now charged.
f.bytes = string.len(ARGV[4])
local fields = {
  f.tenant, f.class, f.weight, f.bytes, f.flags, f.max_running, f.gateway, f.cost, f.adapter,
}
redis.call('HSET', INFO, id, table.concat(fields, '|'))
redis.call('HSET', JOBS, id, ARGV[4])
waiting_add(id, ARGV[5], f)
local wake = KEYS[18]
if f.adapter ~= '' then wake = ARGV[7] .. f.adapter end
redis.call('LPUSH', wake, '1')
redis.call('LTRIM', wake, 0, tonumber(ARGV[6]) - 1)
return 1
""",
    frees=True,
)

_DEAD_LETTER = _script(
    _COMMON_KEYS,
    """
-- KEYS[18] dead, [19] dead bytes. ARGV: 2 id, 3 worker, 4 body, 5 max count, 6 max bytes.
local id = ARGV[2]
if redis.call('HGET', OWNERS, id) ~= ARGV[3] then return 0 end
local f = info(id)
if f then add(RUNNING, f.tenant, -1) end
redis.call('ZREM', LEASES, id)
redis.call('HDEL', OWNERS, id)
redis.call('HDEL', JOBS, id)
redis.call('HDEL', INFO, id)
redis.call('SREM', BATCH, id)
redis.call('LPUSH', KEYS[18], ARGV[4])
local held = redis.call('INCRBY', KEYS[19], string.len(ARGV[4]))
-- Capped by bytes and by count: the oldest go first.
while held > tonumber(ARGV[6]) or redis.call('LLEN', KEYS[18]) > tonumber(ARGV[5]) do
  local oldest = redis.call('RPOP', KEYS[18])
  if not oldest then break end
  held = redis.call('DECRBY', KEYS[19], string.len(oldest))
end
return 1
""",
    frees=True,
)

_RENEW = (
    ALLOW_OOM
    + NOW_MS_LUA
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

_CANCEL = _script(
    _COMMON_KEYS,
    """
-- ARGV: 2 id, 3 the control channel prefix, 4 the Cancel message, 5 record TTL (ms).
-- A waiting job leaves the queue; a claimed one is told to stop; either way (and for a job
-- not seen yet) the cancel is recorded, so a reclaim or a requeue honours it too.
local id = ARGV[2]
redis.call('ZREMRANGEBYSCORE', CANCELLED, '-inf', now)
redis.call('ZADD', CANCELLED, now + tonumber(ARGV[5]), id)
if redis.call('ZSCORE', QUEUE, id) then
  unqueue(id)
  return 'dequeued'
end
local owner = redis.call('HGET', OWNERS, id)
if owner then
  redis.call('PUBLISH', ARGV[3] .. owner, ARGV[4])
  return 'signalled'
end
return 'recorded'
""",
    frees=True,
)

_WITHDRAW = _script(
    _COMMON_KEYS,
    """
-- ARGV: 2 id. A job still waiting leaves the queue ('withdrawn'); a job already claimed
-- (or finished, or unknown) is left alone ('not_waiting').
local id = ARGV[2]
if not redis.call('ZSCORE', QUEUE, id) then return 'not_waiting' end
unqueue(id)
return 'withdrawn'
""",
    frees=True,
)


@dataclass(frozen=True, slots=True)
class Share:
    """A tenant's terms in the queue: its weight in the fair share, and its caps on jobs
    waiting, their bytes, and jobs running at once (0: no cap)."""

    weight: float = 1.0
    max_waiting: int = 0
    max_waiting_bytes: int = 0
    max_running: int = 0


@dataclass(frozen=True, slots=True)
class Enqueued:
    """What an enqueue did. ``job_id`` is the job queued, or, for ``attached`` and
    ``conflict``, the job the request's idempotency key already names."""

    status: EnqueueStatus
    job_id: str


@dataclass(frozen=True, slots=True)
class Position:
    """Where a job would wait: jobs ahead of it in all, its tenant's own jobs ahead of it
    in its class, the tenants waiting in its class (itself included), and its tenant's
    jobs running now."""

    ahead: int
    own_ahead: int
    tenants: int
    running: int = 0
    # Jobs claimed now, by every worker: the live count behind the workers' free slots,
    # which their heartbeats report up to a beat late.
    claimed: int = 0

    @property
    def fair_ahead(self) -> int:
        """Jobs that start before it under the fair share: each waiting tenant of its
        class gets a turn per job of its own, and never more than all that wait."""
        return min(self.ahead, (self.own_ahead + 1) * max(1, self.tenants) - 1)


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


@dataclass(frozen=True, slots=True)
class Claimed:
    """The jobs a claim leased, and Redis's time at the claim (deadlines are judged on
    it, never on a worker's own clock)."""

    now_ms: int
    jobs: list[Job | Poison]
    #: Nothing was left waiting after the claim: another claim would find nothing until
    #: an enqueue, whose wake token the worker can block on instead.
    drained: bool = False


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _decode_pairs(flat: list[bytes]) -> list[Job | Poison]:
    out: list[Job | Poison] = []
    for raw_id, body in zip(flat[::2], flat[1::2], strict=True):
        job_id = _text(raw_id)
        try:
            job = protocol.decode_as(body, Job)
        except protocol.ProtocolError as exc:
            out.append(Poison(job_id, body, str(exc)))
            continue
        out.append(job)
    return out


# The most enqueues one pipeline carries (a flood's clump goes in several).
BATCH_CALLS = 256


class JobQueue:
    """Enqueue, claim, ack, renew and cancel jobs. One instance per process is enough; it
    holds no state beyond its Redis client and registered scripts."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        policy: QueuePolicy = "edf",
        base_model: str | None = None,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self.policy: QueuePolicy = policy
        # A job for any other model names a LoRA adapter (None: no job does).
        self._base_model = base_model
        self._enqueue = _Batched(redis, redis.register_script(_ENQUEUE))
        self._claim = redis.register_script(_CLAIM)
        self._withdraw = redis.register_script(_WITHDRAW)
        self._ack = redis.register_script(_ACK)
        self._renew = redis.register_script(_RENEW)
        self._cancel = redis.register_script(_CANCEL)
        self._reclaim = redis.register_script(_RECLAIM)
        self._requeue = redis.register_script(_REQUEUE)
        self._dead_letter = redis.register_script(_DEAD_LETTER)
        k = keys
        self._common = [
            k.queue,
            k.jobs,
            k.job_info,
            k.tenant_waiting,
            k.tenant_bytes,
            k.tenant_running,
            k.leases,
            k.owners,
            k.batch_jobs,
            k.prefer,
            k.cancelled,
            *(k.backlogged(c) for c in _CLASSES),
            *(k.virtual_time(c) for c in _CLASSES),
        ]
        assert len(self._common) == 17

    def adapter(self, job: Job) -> str:
        """The LoRA adapter ``job`` runs with ('' for the base model): its model, when
        that is not the base model."""
        if self._base_model is None or job.model == self._base_model:
            return ""
        if "|" in job.model:  # the info record's separator; no adapter name has one
            raise ValueError(f"not an adapter name: {job.model!r}")
        return job.model

    def score(self, job: Job) -> int:
        """Queue order (lower runs first): deadline for EDF, with every batch job after
        every latency-bound one; plain arrival for FIFO (a baseline for comparisons, with
        head-of-line blocking and no class order)."""
        if self.policy == "fifo":
            return job.arrival_ms
        batch = job.priority_class == PriorityClass.BATCH
        return job.deadline_ms + (BATCH_SCORE_OFFSET if batch else 0)

    async def enqueue(
        self,
        job: Job,
        meta: bytes = b"",
        meta_ttl_ms: int = 3_600_000,
        prefer: str | None = None,
        prefer_ms: int = 500,
        *,
        share: Share = Share(),
        gateway: str = "",
        resumable: bool = True,
        max_waiting: int = 0,
        idempotency: tuple[str, str] | None = None,
    ) -> Enqueued:
        """Queue ``job`` and wake one idle worker, unless a cap refuses it (the status
        says which) or its id is already queued (``duplicate``).

        ``meta`` (who asked, and how to render the reply) is stored beside the job's reply
        log in the same round trip. ``prefer`` names a worker that should run it (its
        prefix cache holds the conversation): other workers leave the job for
        ``prefer_ms``, and that worker is woken directly. ``gateway`` is the process that
        relays the reply: a job that is not ``resumable`` is dropped at claim once that
        gateway is gone. ``max_waiting`` bounds the whole queue. ``idempotency`` is the
        tenant's ``X-Request-Id`` and a digest of the request: while the reply lives, the
        same id with the same digest is ``attached`` to the job already queued (never a
        second job), with another digest a ``conflict``.
        """
        k = self._keys
        body = protocol.encode(job)
        flags = "r" if resumable else ""
        cost = len(job.prompt_token_ids) + len(job.resume_token_ids)
        adapter = self.adapter(job)
        info = "|".join(
            str(x)
            for x in (
                job.tenant,
                job.priority_class,
                share.weight,
                len(body),
                flags,
                share.max_running,
                gateway,
                cost,
                adapter,
            )
        )
        client_id, digest = idempotency or ("", "")
        reply = await self._enqueue.call(
            [
                *self._common,
                k.wake,
                k.wake_for(prefer or ""),
                k.request_meta(job.id),
                k.idempotency(job.tenant, client_id),
                k.wake_for_adapter(adapter),
            ],
            [
                k.tenant_queue_prefix,
                job.id,
                self.score(job),
                body,
                info,
                meta,
                meta_ttl_ms,
                prefer or "",
                prefer_ms,
                _WAKE_CAP,
                max_waiting,
                share.max_waiting,
                share.max_waiting_bytes,
                f"{job.id}|{digest}" if idempotency else "",
                meta_ttl_ms,
            ],
        )
        status, job_id = (_text(x) for x in reply)
        return Enqueued(status, job_id)  # type: ignore[arg-type]

    async def claim(
        self,
        worker_id: str,
        max_jobs: int,
        lease_ms: int,
        batch_room: int | None = None,
        adapters: Collection[str] = (),
    ) -> Claimed:
        """Atomically take up to ``max_jobs`` jobs (see the module docstring for which)
        and lease them, at most ``batch_room`` of them batch jobs (None: no cap), and of
        the jobs that name a LoRA adapter only those of ``adapters`` (the worker's).

        A body that does not decode comes back as :class:`Poison` (still leased), so the
        caller can dead-letter it instead of letting it block the queue.
        """
        if max_jobs <= 0:
            return Claimed(0, [])
        room = max_jobs if batch_room is None else max(0, batch_room)
        k = self._keys
        wake = [k.wake, k.wake_for(worker_id), *(k.wake_for_adapter(a) for a in sorted(adapters))]
        reply = await self._claim(
            keys=[*self._common, *wake],
            args=[
                self._keys.tenant_queue_prefix,
                worker_id,
                max_jobs,
                lease_ms,
                room,
                self._keys.gateway_alive_prefix,
                *sorted(adapters),
            ],
        )
        return Claimed(int(reply[0]), _decode_pairs(reply[2:]), drained=bool(int(reply[1])))

    async def reclaim_expired(
        self, worker_id: str, lease_ms: int, limit: int = 100
    ) -> list[Job | Poison]:
        """Take over jobs whose lease expired (their worker died or hung).

        The caller now holds their leases and must :meth:`requeue` or :meth:`dead_letter`
        each one (or :meth:`ack` it when it turns out to have finished).
        """
        bodies = await self._reclaim(
            keys=self._common,
            args=[self._keys.tenant_queue_prefix, worker_id, lease_ms, limit],
        )
        return _decode_pairs(bodies)

    async def requeue(self, job: Job, worker_id: str) -> Literal["requeued", "lost", "cancelled"]:
        """Put a job we hold the lease of back in the queue (with its new body): ``lost``
        if the lease is no longer ours, ``cancelled`` (and gone) if it was cancelled."""
        done = await self._requeue(
            keys=[*self._common, self._keys.wake],
            args=[
                self._keys.tenant_queue_prefix,
                job.id,
                worker_id,
                protocol.encode(job),
                self.score(job),
                _WAKE_CAP,
                self._keys.wake_for_adapter_prefix,
            ],
        )
        return {1: "requeued", 0: "lost", -1: "cancelled"}[int(done)]  # type: ignore[return-value]

    async def dead_letter(self, job_id: str, body: bytes, worker_id: str) -> bool:
        """Move a job we hold the lease of to the dead-letter list (capped by count and
        by bytes)."""
        k = self._keys
        done = await self._dead_letter(
            keys=[*self._common, k.dead, k.dead_bytes],
            args=[k.tenant_queue_prefix, job_id, worker_id, body, _DEAD_CAP, DEAD_MAX_BYTES],
        )
        return bool(done)

    async def wait_for_work(
        self,
        redis: aioredis.Redis,
        timeout_s: float,
        worker_id: str = "",
        adapters: Collection[str] = (),
    ) -> bool:
        """Block on the wake lists (this worker's own, its ``adapters``', then the shared
        one) until an enqueue (True) or the timeout (False).

        ``redis`` must be a client whose connection may block (a dedicated one).
        """
        lists = [self._keys.wake_for(worker_id)] if worker_id else []
        lists += [self._keys.wake_for_adapter(a) for a in sorted(adapters)]
        lists.append(self._keys.wake)
        got = await redis.blpop(lists, timeout=timeout_s)
        return got is not None

    async def ack(self, job_id: str, worker_id: str, completion_tokens: int = 0) -> bool:
        """Finish a job: drop its body and lease, and charge its tenant the tokens it
        generated. False if the lease was no longer ours."""
        return (await self.ack_many(worker_id, [(job_id, completion_tokens)]))[0]

    async def ack_many(self, worker_id: str, finished: Sequence[tuple[str, int]]) -> list[bool]:
        """:meth:`ack` for several jobs in one script call: ``finished`` holds (job id,
        tokens generated) pairs. One bool per pair, in order: False where the lease was no
        longer ours."""
        if not finished:
            return []
        args: list[str | int] = [self._keys.tenant_queue_prefix, worker_id]
        for job_id, tokens in finished:
            args += [job_id, tokens]
        done = await self._ack(keys=self._common, args=args)
        return [bool(x) for x in done]

    async def renew(self, worker_id: str, job_ids: list[str], lease_ms: int) -> list[str]:
        """Extend our leases; return the ids whose lease is no longer ours."""
        if not job_ids:
            return []
        k = self._keys
        lost = await self._renew(keys=[k.leases, k.owners], args=[worker_id, lease_ms, *job_ids])
        return [_text(x) for x in lost]

    async def cancel(self, job_id: str, reason: str = "client_disconnected") -> CancelOutcome:
        """Remove a waiting job, or tell the worker running it to abort; the cancel is
        recorded either way, so a reclaim or requeue of the job honours it too."""
        message = protocol.encode(protocol.Cancel(request_id=job_id, reason=reason))
        outcome = await self._cancel(
            keys=self._common,
            args=[
                self._keys.tenant_queue_prefix,
                job_id,
                self._keys.control(""),
                message,
                CANCEL_RECORD_MS,
            ],
        )
        return _text(outcome)  # type: ignore[return-value]

    async def withdraw(self, job_id: str) -> bool:
        """Take ``job_id`` off the queue if it is still waiting (True); a job a worker
        has claimed is left to run (False). For a request whose deadline passed while no
        worker could take it: its gateway refuses it as expired instead of waiting on."""
        outcome = await self._withdraw(
            keys=self._common, args=[self._keys.tenant_queue_prefix, job_id]
        )
        return _text(outcome) == "withdrawn"

    async def cancelled(self, job_ids: list[str]) -> set[str]:
        """Which of ``job_ids`` have a cancel recorded (and not yet expired)."""
        if not job_ids:
            return set()
        scores = await self._redis.zmscore(self._keys.cancelled, job_ids)
        return {j for j, s in zip(job_ids, scores, strict=True) if s is not None}

    async def ahead_of(self, job_score: int) -> int:
        """How many waiting jobs sort before one with this score."""
        return int(await self._redis.zcount(self._keys.queue, "-inf", job_score))

    async def position(self, job: Job) -> Position:
        """Where ``job`` would wait (see :class:`Position`), in one round trip."""
        k, score = self._keys, self.score(job)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zcount(k.queue, "-inf", score)
            pipe.zcount(k.tenant_queue(job.priority_class, job.tenant), "-inf", score)
            pipe.zcard(k.backlogged(job.priority_class))
            pipe.zscore(k.backlogged(job.priority_class), job.tenant)
            pipe.hget(k.tenant_running, job.tenant)
            pipe.zcard(k.leases)
            ahead, own, tenants, waiting, running, claimed = await pipe.execute()
        return Position(
            int(ahead),
            int(own),
            int(tenants) + (0 if waiting is not None else 1),
            int(running or 0),
            int(claimed),
        )

    async def stats(self) -> QueueStats:
        """How many jobs wait and how many are claimed."""
        k = self._keys
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zcard(k.queue)
            pipe.zcard(k.leases)
            waiting, claimed = await pipe.execute()
        return QueueStats(waiting=int(waiting), claimed=int(claimed))


class _Batched:
    """A script whose calls made in one turn of the event loop go to Redis together.

    A burst of requests reaches the gateway's loop in clumps, and each clump's enqueues are
    made in one turn. They go in one pipeline (of at most :data:`BATCH_CALLS` calls): one
    round trip and one task, where each call alone had a round trip and redis-py's task
    for its write. Redis runs what each of its reads brings back to back (up to 16 KB a
    read), so a worker's claim finds the clump in a few parts at most, rather than in as
    many as the round trips that wrote it. A call alone goes at once, as one script call
    (:class:`~cluster.wire.turns.TurnBatch` takes only the calls already made).
    """

    def __init__(self, redis: aioredis.Redis, script: AsyncScript) -> None:
        self._redis = redis
        self._script = script
        self._turn: TurnBatch[tuple[list[Any], list[Any]]] = TurnBatch(self._send)

    async def call(self, keys: list[Any], args: list[Any]) -> Any:
        """The script's reply for ``keys`` and ``args``."""
        return await self._turn.call((keys, args))

    async def _send(self, calls: list[Call[tuple[list[Any], list[Any]]]]) -> None:
        if len(calls) == 1:
            keys, args = calls[0].item
            await self._settle(calls[0], self._script(keys=keys, args=args))
            return
        for at in range(0, len(calls), BATCH_CALLS):
            await self._pipeline(calls[at : at + BATCH_CALLS])

    async def _pipeline(self, calls: list[Call[tuple[list[Any], list[Any]]]]) -> None:
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for call in calls:
                    keys, args = call.item
                    pipe.evalsha(self._script.sha, len(keys), *keys, *args)
                replies = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # the round trip failed: every call in it did
            for call in calls:
                call.answer(exc)
            return
        for call, reply in zip(calls, replies, strict=True):
            if isinstance(reply, NoScriptError):  # Redis restarted: the script loads
                keys, args = call.item
                await self._settle(call, self._script(keys=keys, args=args))
            else:
                call.answer(reply)

    @staticmethod
    async def _settle(call: Call[Any], reply: Awaitable[Any]) -> None:
        try:
            result = await reply
        except Exception as exc:
            result = exc
        call.answer(result)
