"""Characters and sessions of every tenant, stored in Redis.

- A character is an imported card (:mod:`cluster.characters.cards`), stored verbatim so
  unknown fields and ``extensions`` survive a round trip.
- A session binds a character to a user name and holds the conversation; both turns of an
  exchange are appended atomically, only when the reply completes. The session remembers
  the worker that served its last turn, so the next turn can go back to the replica whose
  prefix cache holds the conversation.
- A message is ``{"role", "content"}``; a reply that was swiped also keeps its
  alternatives (``swipes``, at most :data:`MAX_SWIPES`) and which one is shown
  (``swipe_id``, which ``content`` equals). Every change (a swipe, a continued reply, an
  edit, a deletion, a branch) is one Lua script, so it is atomic, and one that finds the
  conversation changed since its reply was asked for records nothing (409 for an edit).

Every key is per tenant (see :class:`cluster.wire.keys.Keys`), so one tenant never sees
another's.
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from cluster.characters.cards import Card, parse_card_json
from cluster.runtime.clock import now_ms
from cluster.wire.keys import Keys
from gateway.http.errors import BadRequest, NotFound, QuotaExceeded

MAX_SWIPES = 32
"""Alternatives kept per reply; a swipe past them forgets the oldest."""


@dataclass(frozen=True, slots=True)
class Character:
    """A stored character."""

    id: str
    created: int
    card: Card
    # The LoRA adapter its turns run with ('' for none: the base model).
    adapter: str = ""

    def summary(self) -> dict[str, Any]:
        """The listing form (no card body)."""
        summary = {
            "id": self.id,
            "object": "character",
            "created": self.created,
            "name": self.card.name,
            "spec": self.card.spec,
        }
        if self.adapter:
            summary["adapter"] = self.adapter
        return summary

    def body(self) -> dict[str, Any]:
        """The full form, with the card document exactly as imported."""
        return {**self.summary(), "card": self.card.to_json()}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@functools.lru_cache(maxsize=256)
def _parse(raw: bytes) -> Character:
    """A stored character record, parsed once (a card is up to 2 MiB of JSON, and a
    session's every turn reads it)."""
    record = json.loads(raw)
    card = parse_card_json(record["card"])
    return Character(record["id"], record["created"], card, record.get("adapter", ""))


async def _character(raw: bytes) -> Character:
    # A large card parses off the event loop.
    if len(raw) < 64 * 1024:
        return _parse(raw)
    return await asyncio.to_thread(_parse, raw)


@dataclass(frozen=True, slots=True)
class Session:
    """A stored session and its conversation so far."""

    id: str
    character_id: str
    user_name: str
    created: int
    last_worker: str
    messages: list[dict[str, Any]]
    summary: str = ""
    """The memory: a summary of the first :attr:`summary_upto` messages."""
    summary_upto: int = 0
    group: tuple[str, ...] = ()
    """A group chat's characters, in order (empty: one character); its replies name
    their speaker (``name``, ``character_id``)."""

    def history(self) -> list[dict[str, str]]:
        """The conversation as the prompt takes it: each message's role and shown text
        (in a group chat, a reply's after its speaker's name), from the first one the
        summary does not cover."""
        return [
            {
                "role": m["role"],
                "content": f"{m['name']}: {m['content']}" if "name" in m else m["content"],
            }
            for m in self.messages[self.summary_upto :]
        ]

    def body(self) -> dict[str, Any]:
        """The API form."""
        body = {
            "id": self.id,
            "object": "session",
            "created": self.created,
            "character_id": self.character_id,
            "user_name": self.user_name,
            "messages": self.messages,
        }
        if self.group:
            body["character_ids"] = list(self.group)
        if self.summary:
            body["memory"] = {"summary": self.summary, "covers": self.summary_upto}
        return body


# Append both turns only if the session still exists (a deleted session stays deleted);
# keep its last ARGV[5] messages (the memory then covers that many fewer), and its keys
# ARGV[6] ms past this activity.
# KEYS: session, turns, the tenant's session index. ARGV: user turn, reply, worker, unix
# time, max messages, ttl ms, session id, now ms.
_APPEND = """#!lua
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local over = redis.call('RPUSH', KEYS[2], ARGV[1], ARGV[2]) - tonumber(ARGV[5])
if over > 0 then
  redis.call('LTRIM', KEYS[2], over, -1)
  local upto = tonumber(redis.call('HGET', KEYS[1], 'summary_upto') or '0')
  if upto > 0 then redis.call('HSET', KEYS[1], 'summary_upto', math.max(upto - over, 0)) end
end
redis.call('HSET', KEYS[1], 'last_worker', ARGV[3], 'updated', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
redis.call('PEXPIRE', KEYS[2], ARGV[6])
redis.call('ZADD', KEYS[3], ARGV[8], ARGV[7])
return 1
"""

# Store a character unless the tenant has ARGV[4] already. KEYS: characters, index.
# ARGV: id, record, summary, cap (0: none).
_ADD_CHARACTER = """#!lua
local cap = tonumber(ARGV[4])
if cap > 0 and redis.call('HLEN', KEYS[1]) >= cap then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
return 1
"""

# Open a session unless the tenant has ARGV[5] live ones (those idle past their TTL are
# pruned from the index first). KEYS: session, turns, index. ARGV: character id, user
# name, unix time, greeting message ('' none), cap, ttl ms, session id, now ms, group
# ('' none: a JSON list of character ids).
_ADD_SESSION = """#!lua
local now, ttl = tonumber(ARGV[8]), tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - ttl)
local cap = tonumber(ARGV[5])
if cap > 0 and redis.call('ZCARD', KEYS[3]) >= cap then return 0 end
redis.call('HSET', KEYS[1], 'character_id', ARGV[1], 'user_name', ARGV[2],
           'created', ARGV[3], 'last_worker', '')
if ARGV[9] ~= '' then redis.call('HSET', KEYS[1], 'group', ARGV[9]) end
redis.call('PEXPIRE', KEYS[1], ttl)
if ARGV[4] ~= '' then
  redis.call('RPUSH', KEYS[2], ARGV[4])
  redis.call('PEXPIRE', KEYS[2], ttl)
end
redis.call('ZADD', KEYS[3], now, ARGV[7])
return 1
"""


# Messages change only if the conversation is still the one the change was asked on:
# ARGV[1] (its length then) equals LLEN; errors come back as {'err'} replies.
# KEYS: session, turns, index. ARGV: expected length, text, worker, unix time, ttl ms,
# session id, now ms, max swipes, mode ('swipe': the text is a new alternative to the last
# reply; 'extend': the text continues it).
_REPLACE_LAST = """#!lua
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local n = redis.call('LLEN', KEYS[2])
if n ~= tonumber(ARGV[1]) or n == 0 then return 0 end
local m = cjson.decode(redis.call('LINDEX', KEYS[2], -1))
if m.role ~= 'assistant' then return 0 end
if ARGV[9] == 'swipe' then
  if m.swipes == nil then m.swipes = {m.content} end
  table.insert(m.swipes, ARGV[2])
  while #m.swipes > tonumber(ARGV[8]) do table.remove(m.swipes, 1) end
  m.content = ARGV[2]
  m.swipe_id = #m.swipes - 1
else
  m.content = m.content .. ARGV[2]
  if m.swipes ~= nil then m.swipes[m.swipe_id + 1] = m.content end
end
redis.call('LSET', KEYS[2], -1, cjson.encode(m))
redis.call('HSET', KEYS[1], 'last_worker', ARGV[3], 'updated', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
redis.call('ZADD', KEYS[3], ARGV[7], ARGV[6])
return 1
"""

# Edit message ARGV[1] (0-based): its text (ARGV[2] 'content') or which alternative it
# shows (ARGV[2] 'swipe_id'); or delete it (ARGV[2] 'delete', ARGV[3] a fresh tombstone).
# KEYS: session, turns. Returns the message as stored, '' once deleted, or an error.
_EDIT = """#!lua
if redis.call('EXISTS', KEYS[1]) == 0 then return redis.error_reply('session') end
local i = tonumber(ARGV[1])
if i >= redis.call('LLEN', KEYS[2]) then return redis.error_reply('index') end
if ARGV[2] == 'delete' then
  redis.call('LSET', KEYS[2], i, ARGV[3])
  redis.call('LREM', KEYS[2], 1, ARGV[3])
  if i < tonumber(redis.call('HGET', KEYS[1], 'summary_upto') or '0') then
    redis.call('HINCRBY', KEYS[1], 'summary_upto', -1)
  end
  return ''
end
local m = cjson.decode(redis.call('LINDEX', KEYS[2], i))
if ARGV[2] == 'content' then
  m.content = ARGV[3]
  if m.swipes ~= nil then m.swipes[m.swipe_id + 1] = m.content end
else
  local k = tonumber(ARGV[3])
  if m.swipes == nil or k >= #m.swipes then return redis.error_reply('swipe') end
  m.swipe_id = k
  m.content = m.swipes[k + 1]
end
local stored = cjson.encode(m)
redis.call('LSET', KEYS[2], i, stored)
return stored
"""

# A new session holding the first ARGV[1] messages of another (same character, user
# name, memory if they hold all it covers, and last worker, whose prefix cache holds
# them), unless the tenant has ARGV[2] live sessions. KEYS: source session, source
# turns, new session, new turns, index. ARGV: messages kept, cap, ttl ms, new id, now ms, unix time.
_BRANCH = """#!lua
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local at = tonumber(ARGV[1])
if at > redis.call('LLEN', KEYS[2]) then return -2 end
local now, ttl = tonumber(ARGV[5]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now - ttl)
local cap = tonumber(ARGV[2])
if cap > 0 and redis.call('ZCARD', KEYS[5]) >= cap then return 0 end
local src = redis.call('HMGET', KEYS[1], 'character_id', 'user_name', 'last_worker',
                      'summary', 'summary_upto', 'group')
redis.call('HSET', KEYS[3], 'character_id', src[1], 'user_name', src[2],
           'created', ARGV[6], 'last_worker', src[3] or '')
if src[6] then redis.call('HSET', KEYS[3], 'group', src[6]) end
-- The memory goes along when the branch holds everything it covers.
if src[4] and tonumber(src[5] or '0') <= at then
  redis.call('HSET', KEYS[3], 'summary', src[4], 'summary_upto', src[5])
end
redis.call('PEXPIRE', KEYS[3], ttl)
local i = 0
while i < at do
  local part = redis.call('LRANGE', KEYS[2], i, math.min(i + 99, at - 1))
  redis.call('RPUSH', KEYS[4], unpack(part))
  i = i + 100
end
if at > 0 then redis.call('PEXPIRE', KEYS[4], ttl) end
redis.call('ZADD', KEYS[5], now, ARGV[4])
return 1
"""


# Take the session's summary job unless another gateway holds it (for less than ARGV[2]
# ms). KEYS: session. ARGV: now ms, hold ms. 1: taken.
_CLAIM_SUMMARY = """#!lua
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local held = tonumber(redis.call('HGET', KEYS[1], 'summary_pending') or '0')
if tonumber(ARGV[1]) - held < tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'summary_pending', ARGV[1])
return 1
"""

# Store a summary of the first ARGV[2] messages if the memory still covers ARGV[1] (no
# deletion or trim moved it meanwhile), and release the job. KEYS: session.
# ARGV: covered before, covered now, summary.
_RECORD_SUMMARY = """#!lua
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HDEL', KEYS[1], 'summary_pending')
if tonumber(redis.call('HGET', KEYS[1], 'summary_upto') or '0') ~= tonumber(ARGV[1]) then
  return 0
end
redis.call('HSET', KEYS[1], 'summary', ARGV[3], 'summary_upto', ARGV[2])
return 1
"""


class CharacterStore:
    """Characters and sessions of every tenant."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        session_ttl_s: int = 30 * 86_400,
        max_session_messages: int = 2_000,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._session_ttl_ms = session_ttl_s * 1000
        self._max_messages = max_session_messages
        self._append = redis.register_script(_APPEND)
        self._add_character = redis.register_script(_ADD_CHARACTER)
        self._add_session = redis.register_script(_ADD_SESSION)
        self._replace_last = redis.register_script(_REPLACE_LAST)
        self._edit = redis.register_script(_EDIT)
        self._branch = redis.register_script(_BRANCH)
        self._claim_summary = redis.register_script(_CLAIM_SUMMARY)
        self._record_summary = redis.register_script(_RECORD_SUMMARY)

    async def create_character(
        self, tenant: str, card: Card, max_characters: int = 0, adapter: str = ""
    ) -> Character:
        """Store ``card`` as a new character (:class:`QuotaExceeded` past
        ``max_characters``), speaking through LoRA ``adapter`` if one is named."""
        character = Character(f"char_{secrets.token_hex(8)}", int(time.time()), card, adapter)
        record: dict[str, Any] = {
            "id": character.id,
            "created": character.created,
            "card": card.to_json(),
        }
        if adapter:
            record["adapter"] = adapter
        summary = character.summary()
        added = await self._add_character(
            keys=[self._keys.characters(tenant), self._keys.character_index(tenant)],
            args=[character.id, json.dumps(record), json.dumps(summary), max_characters],
        )
        if not added:
            raise QuotaExceeded(f"this tenant has {max_characters} characters, its limit")
        return character

    async def character(self, tenant: str, character_id: str) -> Character:
        """One character; 404 if this tenant has none by that id."""
        raw = await self._redis.hget(self._keys.characters(tenant), character_id)
        if raw is None:
            raise NotFound(
                f"No character with id {character_id!r}.",
                param="character_id",
                code="character_not_found",
            )
        return await _character(raw if isinstance(raw, bytes) else raw.encode())

    async def summaries(self, tenant: str) -> list[dict[str, Any]]:
        """Every character of the tenant, as listed (no card), oldest first."""
        index = await self._redis.hgetall(self._keys.character_index(tenant))
        found = {_text(k): json.loads(v) for k, v in index.items()}
        # Characters stored before the index existed are read (and indexed) once.
        stored = await self._redis.hkeys(self._keys.characters(tenant))
        for raw_id in stored:
            character_id = _text(raw_id)
            if character_id not in found:
                summary = (await self.character(tenant, character_id)).summary()
                found[character_id] = summary
                key = self._keys.character_index(tenant)
                await self._redis.hset(key, character_id, json.dumps(summary))
        return sorted(found.values(), key=lambda r: (r["created"], r["id"]))

    async def delete_character(self, tenant: str, character_id: str) -> bool:
        """Delete a character (its sessions stay readable but can no longer chat)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self._keys.characters(tenant), character_id)
            pipe.hdel(self._keys.character_index(tenant), character_id)
            removed, _ = await pipe.execute()
        return bool(removed)

    async def create_session(
        self,
        tenant: str,
        character: Character,
        user_name: str,
        greeting: str,
        max_sessions: int = 0,
        group: tuple[Character, ...] = (),
    ) -> Session:
        """A new session that opens with ``greeting`` from the character
        (:class:`QuotaExceeded` past ``max_sessions`` live ones); a group chat when
        ``group`` names its characters (``character`` among them, who greets)."""
        opening: dict[str, Any] = {"role": "assistant", "content": greeting}
        if group:
            opening.update(speaker(character))
        session = Session(
            f"sess_{secrets.token_hex(8)}",
            character.id,
            user_name,
            int(time.time()),
            "",
            [opening] if greeting else [],
            group=tuple(c.id for c in group),
        )
        greeting_message = json.dumps(session.messages[0]) if session.messages else ""
        added = await self._add_session(
            keys=[
                self._keys.session(tenant, session.id),
                self._keys.session_turns(tenant, session.id),
                self._keys.sessions(tenant),
            ],
            args=[
                character.id,
                user_name,
                session.created,
                greeting_message,
                max_sessions,
                self._session_ttl_ms,
                session.id,
                now_ms(),
                json.dumps(session.group) if session.group else "",
            ],
        )
        if not added:
            raise QuotaExceeded(f"this tenant has {max_sessions} sessions, its limit")
        return session

    async def session(self, tenant: str, session_id: str) -> Session:
        """One session with its messages; 404 if this tenant has none by that id."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(self._keys.session(tenant, session_id))
            pipe.lrange(self._keys.session_turns(tenant, session_id), 0, -1)
            fields, turns = await pipe.execute()
        if not fields:
            raise _no_session(session_id)
        text = {k.decode(): v.decode() for k, v in fields.items()}
        messages = [json.loads(t) for t in turns]
        return Session(
            session_id,
            text["character_id"],
            text["user_name"],
            int(text["created"]),
            text.get("last_worker", ""),
            messages,
            text.get("summary", ""),
            min(int(text.get("summary_upto", "0")), len(messages)),
            tuple(json.loads(text["group"])) if "group" in text else (),
        )

    async def character_worker(self, tenant: str, character_id: str) -> str:
        """The worker that last served this character (its persona prefix is cached
        there), or ''."""
        raw = await self._redis.hget(self._keys.character_worker(tenant), character_id)
        return raw.decode() if isinstance(raw, bytes) else str(raw or "")

    async def note_character_worker(self, tenant: str, character_id: str, worker: str) -> None:
        """Remember where this character last ran."""
        await self._redis.hset(self._keys.character_worker(tenant), character_id, worker)

    async def delete_session(self, tenant: str, session_id: str) -> bool:
        """Delete a session and its conversation."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(
                self._keys.session(tenant, session_id),
                self._keys.session_turns(tenant, session_id),
            )
            pipe.zrem(self._keys.sessions(tenant), session_id)
            removed, _ = await pipe.execute()
        return bool(removed)

    async def append_turn(
        self,
        tenant: str,
        session_id: str,
        user: str,
        reply: str,
        worker_id: str,
        by: dict[str, str] | None = None,
    ) -> bool:
        """Append a completed exchange (in a group chat, ``by`` names the speaker: see
        :func:`speaker`); False if the session was deleted meanwhile."""
        done = await self._append(
            keys=[
                self._keys.session(tenant, session_id),
                self._keys.session_turns(tenant, session_id),
                self._keys.sessions(tenant),
            ],
            args=[
                json.dumps({"role": "user", "content": user}),
                json.dumps({"role": "assistant", "content": reply, **(by or {})}),
                worker_id,
                int(time.time()),
                self._max_messages,
                self._session_ttl_ms,
                session_id,
                now_ms(),
            ],
        )
        return bool(done)

    async def replace_last(
        self,
        tenant: str,
        session_id: str,
        expected_len: int,
        text: str,
        worker_id: str,
        mode: str,
    ) -> bool:
        """Record a swipe (``mode`` 'swipe': ``text`` becomes the last reply, its former
        text kept as an alternative) or a continued reply ('extend': ``text`` is appended
        to it); False if the conversation changed since it had ``expected_len`` messages."""
        done = await self._replace_last(
            keys=[
                self._keys.session(tenant, session_id),
                self._keys.session_turns(tenant, session_id),
                self._keys.sessions(tenant),
            ],
            args=[
                expected_len,
                text,
                worker_id,
                int(time.time()),
                self._session_ttl_ms,
                session_id,
                now_ms(),
                MAX_SWIPES,
                mode,
            ],
        )
        return bool(done)

    async def edit_message(
        self, tenant: str, session_id: str, index: int, what: str, value: str | int
    ) -> dict[str, Any] | None:
        """Change message ``index``: its text (``what`` 'content'), the alternative it
        shows ('swipe_id'), or delete it ('delete', then None). 404 for no such session or
        message, 400 for no such alternative."""
        value = secrets.token_hex(16) if what == "delete" else value
        try:
            stored = await self._edit(
                keys=[
                    self._keys.session(tenant, session_id),
                    self._keys.session_turns(tenant, session_id),
                ],
                args=[index, what, value],
            )
        except ResponseError as exc:
            reason = str(exc)
            if reason == "swipe":
                raise BadRequest(
                    f"message {index} has no alternative {value}", param="swipe_id"
                ) from exc
            if reason == "index":
                raise NotFound(
                    f"session {session_id!r} has no message {index}",
                    param="index",
                    code="message_not_found",
                ) from exc
            if reason == "session":
                raise _no_session(session_id) from exc
            raise
        if what == "delete":
            return None
        return dict(json.loads(stored))

    async def branch(self, tenant: str, session_id: str, at: int, max_sessions: int = 0) -> Session:
        """A new session with the first ``at`` messages of ``session_id`` (a copy: the
        two then go their own ways). 404, 400 past its length, quota past
        ``max_sessions``."""
        new_id = f"sess_{secrets.token_hex(8)}"
        done = await self._branch(
            keys=[
                self._keys.session(tenant, session_id),
                self._keys.session_turns(tenant, session_id),
                self._keys.session(tenant, new_id),
                self._keys.session_turns(tenant, new_id),
                self._keys.sessions(tenant),
            ],
            args=[at, max_sessions, self._session_ttl_ms, new_id, now_ms(), int(time.time())],
        )
        if done == -1:
            raise _no_session(session_id)
        if done == -2:
            raise BadRequest(f"session {session_id!r} has fewer than {at} messages", param="at")
        if not done:
            raise QuotaExceeded(f"this tenant has {max_sessions} sessions, its limit")
        return await self.session(tenant, new_id)

    async def claim_summary(self, tenant: str, session_id: str, hold_ms: int) -> bool:
        """Take the session's summary job (False: another holds it, for up to
        ``hold_ms``, or the session is gone)."""
        taken = await self._claim_summary(
            keys=[self._keys.session(tenant, session_id)], args=[now_ms(), hold_ms]
        )
        return bool(taken)

    async def record_summary(
        self, tenant: str, session_id: str, covered: int, now_covers: int, summary: str
    ) -> bool:
        """Store ``summary`` of the first ``now_covers`` messages, if the memory still
        covers ``covered`` (else the job's view is stale: False); the job is released
        either way (an empty ``summary`` only releases it)."""
        if not summary:
            await self._redis.hdel(self._keys.session(tenant, session_id), "summary_pending")
            return False
        done = await self._record_summary(
            keys=[self._keys.session(tenant, session_id)],
            args=[covered, now_covers, summary],
        )
        return bool(done)


def speaker(character: Character) -> dict[str, str]:
    """How a group chat's reply names who said it."""
    return {"name": character.card.display_name, "character_id": character.id}


def _no_session(session_id: str) -> NotFound:
    return NotFound(
        f"No session with id {session_id!r}.", param="session_id", code="session_not_found"
    )
