"""Files and batches of the OpenAI Batch API, kept in Redis so they outlive any gateway.

A batch is an uploaded JSONL file of chat requests that runs at low priority on the same
queue as live chat (:mod:`gateway.batches.runner` runs it). Everything a batch is lives in
Redis: its object, a private copy of its input, one result per line, and the leases of the
lines being run, so a gateway that restarts (or any other gateway) picks up where another
stopped, and a line's result is written exactly once (``HSETNX``).

Layout (under the namespace; ``{t}`` is the tenant, so another tenant's id is simply not
found):

- ``file:{t}:{id}`` hash: the file object (``bytes``, ``created_at``, ``filename``,
  ``purpose``); ``file-data:{t}:{id}`` string: its content; ``files:{t}`` sorted set of the
  tenant's file ids by creation (ms).
- ``batch-obj:{t}:{id}`` hash: ``status``, the OpenAI timestamps, ``total``,
  ``completed``, ``failed``, ``cursor`` (next line never claimed), ``output_file_id``,
  ``error_file_id``, ``errors`` (JSON) and ``static`` (JSON: the fields that never change).
- ``batch-list:{t}`` sorted set of the tenant's batch ids by creation (ms).
- ``batch-active`` set of ``{t}/{id}`` for every batch not yet in a final state: what the
  runners poll.
- ``batch-input:{t}:{id}`` string: the input file, copied when the batch is created (so
  deleting the file does not strand the batch).
- ``batch-results:{t}:{id}`` hash: line index -> ``o`` or ``e`` + the output/error line.
- ``batch-leases:{t}:{id}`` sorted set: line index -> lease expiry (Redis time, ms).
- ``batch-owners:{t}:{id}`` hash: line index -> id of the job running it now.
- ``batch-lock:{t}:{id}`` string: who validates or finalizes the batch right now.

The per-batch result, lease, owner and input keys are deleted when the batch reaches a
final state; its object and files stay.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from cluster.runtime.clock import now_ms
from cluster.wire.keys import Keys
from cluster.wire.queue import ALLOW_OOM, NOW_MS_LUA
from gateway.batches.objects import (
    ENDPOINT,
    WINDOW_S,
    BatchState,
    FileObject,
    as_text,
    new_batch_id,
    new_file_id,
)
from gateway.http.errors import QuotaExceeded


def member(tenant: str, batch_id: str) -> str:
    """A batch's entry in the active set."""
    return f"{tenant}/{batch_id}"


def split_member(value: str) -> tuple[str, str]:
    """``(tenant, batch_id)`` of an active-set entry."""
    tenant, _, batch_id = value.partition("/")
    return tenant, batch_id


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


# Record one line's result exactly once, and only while the batch is not final.
# KEYS: obj, results, leases, owners. ARGV: index, value, counter ('completed', 'failed'
# or '' for none). Returns 1 (recorded), 0 (already had one), -1 (batch final or gone).
_RECORD = """
local st = redis.call('HGET', KEYS[1], 'status')
if (not st) or st == 'completed' or st == 'failed' or st == 'expired' or st == 'cancelled' then
  return -1
end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
if ARGV[3] ~= '' then redis.call('HINCRBY', KEYS[1], ARGV[3], 1) end
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
return 1
"""

# Lease up to ARGV[1] lines, keeping at most ARGV[2] leased for the whole batch: first lines
# whose lease expired (their previous job id is returned so it can be cancelled), then lines
# never claimed (from the cursor). KEYS: obj, results, leases, owners. ARGV: want, cap,
# lease_ms, job id prefix. Returns a flat list: index, job id, previous job id ('' if none).
_CLAIM = (
    NOW_MS_LUA
    + """
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' then return {} end
local until_ms = now + tonumber(ARGV[3])
local room = math.min(tonumber(ARGV[1]),
                      tonumber(ARGV[2]) - redis.call('ZCOUNT', KEYS[3], now, '+inf'))
local out = {}
if room <= 0 then return out end
local stale = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. now, 'LIMIT', 0, room)
for _, idx in ipairs(stale) do
  if redis.call('HEXISTS', KEYS[2], idx) == 1 then
    redis.call('ZREM', KEYS[3], idx)
    redis.call('HDEL', KEYS[4], idx)
  else
    local old = redis.call('HGET', KEYS[4], idx) or ''
    local job = ARGV[4] .. idx
    redis.call('ZADD', KEYS[3], until_ms, idx)
    redis.call('HSET', KEYS[4], idx, job)
    table.insert(out, idx)
    table.insert(out, job)
    table.insert(out, old)
    room = room - 1
  end
end
local total = tonumber(redis.call('HGET', KEYS[1], 'total') or '0')
local scanned = 0
while room > 0 and scanned < 10000 do
  local idx = redis.call('HINCRBY', KEYS[1], 'cursor', 1) - 1
  if idx >= total then
    redis.call('HSET', KEYS[1], 'cursor', total)
    break
  end
  scanned = scanned + 1
  local key = tostring(idx)
  if redis.call('HEXISTS', KEYS[2], key) == 0 and not redis.call('ZSCORE', KEYS[3], key) then
    local job = ARGV[4] .. key
    redis.call('ZADD', KEYS[3], until_ms, key)
    redis.call('HSET', KEYS[4], key, job)
    table.insert(out, key)
    table.insert(out, job)
    table.insert(out, '')
    room = room - 1
  end
end
return out
"""
)

# Extend the leases of lines this process still owns. KEYS: owners, leases. ARGV: lease_ms,
# then index, job id pairs. Returns the indexes no longer owned (taken over elsewhere).
# Through a full Redis too, as the queue's renewals: it only moves the expiry of leases that
# exist (ZADD XX), and a lease that expired there would hand the line to another gateway.
_RENEW = (
    ALLOW_OOM
    + NOW_MS_LUA
    + """
local until_ms = now + tonumber(ARGV[1])
local lost = {}
for i = 2, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    redis.call('ZADD', KEYS[2], 'XX', until_ms, ARGV[i])
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""
)

# Change the job running a line (a retry) or give the line up (new job id ''), only while
# this process owns it. A line given up keeps a lease that expired long ago, so the next
# claim takes it at once. KEYS: owners, leases. ARGV: index, current job id, new job id.
_REOWN = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZADD', KEYS[2], 'XX', 0, ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
end
return 1
"""

# Move a batch from one of the statuses in ARGV[1] (comma-separated) to ARGV[2], stamping
# ARGV[3] (a timestamp field, or '') with ARGV[4] and setting the field/value pairs after
# that. Reaching a final status removes the batch from the active set (member ARGV[5]) and
# deletes its working keys. KEYS: obj, active, input, results, leases, owners.
# Returns 'ok', or the current status when it is not one of ARGV[1] ('' if no batch).
_TRANSITION = (
    ALLOW_OOM
    + """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return '' end
local allowed = false
for s in string.gmatch(ARGV[1], '[^,]+') do
  if s == st then allowed = true end
end
if not allowed then return st end
redis.call('HSET', KEYS[1], 'status', ARGV[2])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], ARGV[3], ARGV[4]) end
for i = 8, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if ARGV[2] == 'completed' or ARGV[2] == 'failed' or ARGV[2] == 'expired'
   or ARGV[2] == 'cancelled' then
  redis.call('SREM', KEYS[2], ARGV[5])
  redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[6])
  -- A finished batch no longer counts against its tenant's quota, and its object lives
  -- as long as its files do.
  redis.call('SREM', KEYS[7], ARGV[6])
  redis.call('PEXPIRE', KEYS[1], ARGV[7])
end
return 'ok'
"""
)

# Store a file unless it is new and the tenant's quota (count or bytes) refuses it; its
# keys expire after ARGV[8] ms, and index entries past that are pruned first.
# KEYS: file hash, file data, files index (by creation), sizes. ARGV: id, bytes,
# created_at, filename, purpose, data, now ms, ttl ms, max files, max bytes (0: none).
# Returns 'ok', 'files' or 'bytes'.
_PUT_FILE = """#!lua
local now, ttl = tonumber(ARGV[7]), tonumber(ARGV[8])
for _, old in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now - ttl)) do
  redis.call('HDEL', KEYS[4], old)
  redis.call('ZREM', KEYS[3], old)
end
if redis.call('HEXISTS', KEYS[4], ARGV[1]) == 0 then
  local max_files, max_bytes = tonumber(ARGV[9]), tonumber(ARGV[10])
  if max_files > 0 and redis.call('ZCARD', KEYS[3]) >= max_files then return 'files' end
  if max_bytes > 0 then
    local total = tonumber(ARGV[2])
    for _, size in ipairs(redis.call('HVALS', KEYS[4])) do total = total + tonumber(size) end
    if total > max_bytes then return 'bytes' end
  end
end
redis.call('HSET', KEYS[1], 'bytes', ARGV[2], 'created_at', ARGV[3], 'filename', ARGV[4],
           'purpose', ARGV[5])
redis.call('SET', KEYS[2], ARGV[6], 'PX', ttl)
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('ZADD', KEYS[3], now, ARGV[1])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[2])
return 'ok'
"""

# Release a lock only if we still hold it.
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True, slots=True)
class Claim:
    """A line leased to this process: its index, the job id to run it under, and the job
    a previous owner may still have queued (to cancel)."""

    index: int
    job_id: str
    previous_job_id: str


class BatchStore:
    """Every Redis operation on files and batches."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, ttl_s: int = 30 * 86_400) -> None:
        self._redis = redis
        self.keys = keys
        self._ttl_ms = ttl_s * 1000
        self._put_file = redis.register_script(_PUT_FILE)
        self._record = redis.register_script(_RECORD)
        self._claim = redis.register_script(_CLAIM)
        self._renew = redis.register_script(_RENEW)
        self._reown = redis.register_script(_REOWN)
        self._transition = redis.register_script(_TRANSITION)
        self._unlock = redis.register_script(_UNLOCK)

    # -- files ----------------------------------------------------------------------

    async def put_file(
        self,
        tenant: str,
        filename: str,
        purpose: str,
        data: bytes,
        file_id: str | None = None,
        *,
        max_files: int = 0,
        max_bytes: int = 0,
    ) -> FileObject:
        """Store a file (an existing id is overwritten: finalizing is idempotent); a new
        one past the tenant's ``max_files`` or ``max_bytes`` is refused (429). Files
        expire after the store's TTL."""
        file = FileObject(file_id or new_file_id(), len(data), int(time.time()), filename, purpose)
        k = self.keys
        outcome = await self._put_file(
            keys=[
                k.file(tenant, file.id),
                k.file_data(tenant, file.id),
                k.files(tenant),
                k.file_sizes(tenant),
            ],
            args=[
                file.id,
                file.bytes,
                file.created_at,
                filename,
                purpose,
                data,
                now_ms(),
                self._ttl_ms,
                max_files,
                max_bytes,
            ],
        )
        if as_text(outcome) == "files":
            raise QuotaExceeded(f"this tenant stores {max_files} files, its limit")
        if as_text(outcome) == "bytes":
            raise QuotaExceeded(f"this tenant's files would hold more than {max_bytes} bytes")
        return file

    async def file(self, tenant: str, file_id: str) -> FileObject | None:
        """A file's metadata, or None if the tenant has no such file."""
        raw = await self._redis.hgetall(self.keys.file(tenant, file_id))
        if not raw:
            return None
        fields = {as_text(k): as_text(v) for k, v in raw.items()}
        return FileObject(
            file_id,
            int(fields["bytes"]),
            int(fields["created_at"]),
            fields["filename"],
            fields["purpose"],
        )

    async def file_content(self, tenant: str, file_id: str) -> bytes | None:
        """A file's content, or None."""
        data = await self._redis.get(self.keys.file_data(tenant, file_id))
        return _bytes(data) if data is not None else None

    async def files(self, tenant: str) -> list[FileObject]:
        """The tenant's files, newest first."""
        ids = [as_text(i) for i in await self._redis.zrevrange(self.keys.files(tenant), 0, -1)]
        found = [await self.file(tenant, i) for i in ids]
        return [f for f in found if f is not None]

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        """Delete a file; False if there was none."""
        k = self.keys
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(k.file(tenant, file_id), k.file_data(tenant, file_id))
            pipe.zrem(k.files(tenant), file_id)
            pipe.hdel(k.file_sizes(tenant), file_id)
            removed, *_ = await pipe.execute()
        return bool(removed)

    # -- batches --------------------------------------------------------------------

    async def create_batch(
        self,
        tenant: str,
        input_file_id: str,
        metadata: dict[str, str] | None,
        max_open: int = 0,
        endpoint: str = ENDPOINT,
    ) -> BatchState | None:
        """A new batch in ``validating``, with a private copy of its input file; None if
        the input file vanished meanwhile; 429 when the tenant has ``max_open`` batches
        not yet finished."""
        if max_open and await self._redis.scard(self.keys.batches_open(tenant)) >= max_open:
            raise QuotaExceeded(f"this tenant has {max_open} unfinished batches, its limit")
        now = int(time.time())
        state = BatchState(
            id=new_batch_id(),
            tenant=tenant,
            status="validating",
            input_file_id=input_file_id,
            created_at=now,
            expires_at=now + WINDOW_S,
            metadata=metadata,
            endpoint=endpoint,
        )
        static = {
            "endpoint": endpoint,
            "id": state.id,
            "input_file_id": input_file_id,
            "created_at": now,
            "expires_at": state.expires_at,
            "metadata": metadata,
        }
        k = self.keys
        copied = await self._redis.copy(
            k.file_data(tenant, input_file_id), k.batch_input(tenant, state.id), replace=True
        )
        if not copied:
            return None
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                k.batch_object(tenant, state.id),
                mapping={
                    "static": json.dumps(static),
                    "status": "validating",
                    "expires_at": state.expires_at,
                    "total": 0,
                    "completed": 0,
                    "failed": 0,
                    "cursor": 0,
                },
            )
            pipe.zadd(k.batch_list(tenant), {state.id: now_ms()})
            pipe.sadd(k.batch_active, member(tenant, state.id))
            pipe.sadd(k.batches_open(tenant), state.id)
            await pipe.execute()
        return state

    async def batch(self, tenant: str, batch_id: str) -> BatchState | None:
        """A batch, or None if the tenant has none by that id."""
        raw = await self._redis.hgetall(self.keys.batch_object(tenant, batch_id))
        return BatchState.from_hash(tenant, raw) if raw else None

    async def batch_ids(self, tenant: str, after: str | None, limit: int) -> tuple[list[str], bool]:
        """Up to ``limit`` batch ids, newest first, after the id ``after``; and whether
        more follow."""
        key = self.keys.batch_list(tenant)
        start = 0
        if after:
            rank = await self._redis.zrevrank(key, after)
            if rank is None:
                return [], False
            start = int(rank) + 1  # type: ignore[arg-type]
        ids = [as_text(i) for i in await self._redis.zrevrange(key, start, start + limit)]
        return ids[:limit], len(ids) > limit

    async def active(self) -> list[tuple[str, str]]:
        """``(tenant, batch_id)`` of every batch not yet final."""
        return [
            split_member(as_text(m)) for m in await self._redis.smembers(self.keys.batch_active)
        ]

    async def input(self, tenant: str, batch_id: str) -> bytes | None:
        """The batch's copy of its input file."""
        data = await self._redis.get(self.keys.batch_input(tenant, batch_id))
        return _bytes(data) if data is not None else None

    async def transition(
        self,
        tenant: str,
        batch_id: str,
        allowed: tuple[str, ...],
        to: str,
        stamp: str = "",
        **fields: str | int,
    ) -> str:
        """Move the batch to ``to`` if its status is one of ``allowed``; 'ok', or the
        status it has instead ('' if there is no such batch)."""
        k = self.keys
        args: list[str | int] = [",".join(allowed), to, stamp, int(time.time())]
        args += [member(tenant, batch_id), batch_id, self._ttl_ms]
        for name, value in fields.items():
            args += [name, value]
        outcome = await self._transition(
            keys=[
                k.batch_object(tenant, batch_id),
                k.batch_active,
                k.batch_input(tenant, batch_id),
                k.batch_results(tenant, batch_id),
                k.batch_leases(tenant, batch_id),
                k.batch_owners(tenant, batch_id),
                k.batches_open(tenant),
            ],
            args=args,
        )
        return as_text(outcome)

    async def set_total(self, tenant: str, batch_id: str, total: int) -> None:
        """Record how many request lines the batch has (known once it is parsed)."""
        await self._redis.hset(self.keys.batch_object(tenant, batch_id), "total", total)

    # -- lines ----------------------------------------------------------------------

    async def record(
        self, tenant: str, batch_id: str, index: int, value: bytes, counter: str
    ) -> int:
        """Record a line's result once: 1 recorded, 0 it had one, -1 the batch is final."""
        k = self.keys
        done = await self._record(
            keys=[
                k.batch_object(tenant, batch_id),
                k.batch_results(tenant, batch_id),
                k.batch_leases(tenant, batch_id),
                k.batch_owners(tenant, batch_id),
            ],
            args=[index, value, counter],
        )
        return int(done)

    async def claim(
        self, tenant: str, batch_id: str, want: int, cap: int, lease_ms: int
    ) -> list[Claim]:
        """Lease up to ``want`` lines (the batch keeps at most ``cap`` leased)."""
        if want <= 0:
            return []
        k = self.keys
        prefix = f"batch_req_{secrets.token_hex(6)}_"
        flat = await self._claim(
            keys=[
                k.batch_object(tenant, batch_id),
                k.batch_results(tenant, batch_id),
                k.batch_leases(tenant, batch_id),
                k.batch_owners(tenant, batch_id),
            ],
            args=[want, cap, lease_ms, prefix],
        )
        items = [as_text(x) for x in flat]
        return [Claim(int(items[i]), items[i + 1], items[i + 2]) for i in range(0, len(items), 3)]

    async def renew(
        self, tenant: str, batch_id: str, owned: dict[int, str], lease_ms: int
    ) -> list[int]:
        """Extend the leases of ``owned`` (index -> job id); the indexes lost meanwhile."""
        if not owned:
            return []
        k = self.keys
        args: list[str | int] = [lease_ms]
        for index, job_id in owned.items():
            args += [index, job_id]
        lost = await self._renew(
            keys=[k.batch_owners(tenant, batch_id), k.batch_leases(tenant, batch_id)], args=args
        )
        return [int(as_text(x)) for x in lost]

    async def reown(self, tenant: str, batch_id: str, index: int, job_id: str, new: str) -> bool:
        """Run the line under job ``new`` (or give it up when ``new`` is ''), if this
        process still owns it under ``job_id``."""
        k = self.keys
        done = await self._reown(
            keys=[k.batch_owners(tenant, batch_id), k.batch_leases(tenant, batch_id)],
            args=[index, job_id, new],
        )
        return bool(done)

    async def live_leases(self, tenant: str, batch_id: str) -> int:
        """Lines leased and not yet expired."""
        # Lease scores are Redis time: compare with Redis's clock, not this process's.
        seconds, micros = await self._redis.time()
        now_ms = seconds * 1000 + micros // 1000
        return int(
            await self._redis.zcount(self.keys.batch_leases(tenant, batch_id), now_ms, "+inf")
        )

    async def result_count(self, tenant: str, batch_id: str) -> int:
        """Lines with a result."""
        return int(await self._redis.hlen(self.keys.batch_results(tenant, batch_id)))

    async def missing(self, tenant: str, batch_id: str, total: int) -> list[int]:
        """Indexes of lines without a result."""
        have = {
            int(as_text(i))
            for i in await self._redis.hkeys(self.keys.batch_results(tenant, batch_id))
        }
        return [i for i in range(total) if i not in have]

    async def results(self, tenant: str, batch_id: str) -> dict[int, bytes]:
        """Every recorded result (index -> ``o``/``e`` + JSON line)."""
        out: dict[int, bytes] = {}
        async for index, value in self._redis.hscan_iter(
            self.keys.batch_results(tenant, batch_id), count=1000
        ):
            out[int(as_text(index))] = _bytes(value)
        return out

    async def lock(self, tenant: str, batch_id: str, ttl_ms: int) -> str | None:
        """Take the batch's validate/finalize lock; its token, or None if held."""
        token = secrets.token_hex(8)
        ok = await self._redis.set(
            self.keys.batch_lock(tenant, batch_id), token, nx=True, px=ttl_ms
        )
        return token if ok else None

    async def unlock(self, tenant: str, batch_id: str, token: str) -> None:
        """Release the lock if still ours."""
        await self._unlock(keys=[self.keys.batch_lock(tenant, batch_id)], args=[token])
