"""Characters and sessions of every tenant, stored in Redis.

- A character is an imported card (:mod:`cluster.characters.cards`), stored verbatim so
  unknown fields and ``extensions`` survive a round trip.
- A session binds a character to a user name and holds the conversation; both turns of an
  exchange are appended atomically, only when the reply completes. The session remembers
  the worker that served its last turn, so the next turn can go back to the replica whose
  prefix cache holds the conversation.

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

from cluster.characters.cards import Card, parse_card_json
from cluster.runtime.clock import now_ms
from cluster.wire.keys import Keys
from gateway.http.errors import NotFound, QuotaExceeded


@dataclass(frozen=True, slots=True)
class Character:
    """A stored character."""

    id: str
    created: int
    card: Card

    def summary(self) -> dict[str, Any]:
        """The listing form (no card body)."""
        return {
            "id": self.id,
            "object": "character",
            "created": self.created,
            "name": self.card.name,
            "spec": self.card.spec,
        }

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
    return Character(record["id"], record["created"], parse_card_json(record["card"]))


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
    messages: list[dict[str, str]]

    def body(self) -> dict[str, Any]:
        """The API form."""
        return {
            "id": self.id,
            "object": "session",
            "created": self.created,
            "character_id": self.character_id,
            "user_name": self.user_name,
            "messages": self.messages,
        }


# Append both turns only if the session still exists (a deleted session stays deleted);
# keep its last ARGV[5] messages, and its keys ARGV[6] ms past this activity.
# KEYS: session, turns, the tenant's session index. ARGV: user turn, reply, worker, unix
# time, max messages, ttl ms, session id, now ms.
_APPEND = """#!lua
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[1], ARGV[2])
redis.call('LTRIM', KEYS[2], -tonumber(ARGV[5]), -1)
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
# name, unix time, greeting message ('' none), cap, ttl ms, session id, now ms.
_ADD_SESSION = """#!lua
local now, ttl = tonumber(ARGV[8]), tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - ttl)
local cap = tonumber(ARGV[5])
if cap > 0 and redis.call('ZCARD', KEYS[3]) >= cap then return 0 end
redis.call('HSET', KEYS[1], 'character_id', ARGV[1], 'user_name', ARGV[2],
           'created', ARGV[3], 'last_worker', '')
redis.call('PEXPIRE', KEYS[1], ttl)
if ARGV[4] ~= '' then
  redis.call('RPUSH', KEYS[2], ARGV[4])
  redis.call('PEXPIRE', KEYS[2], ttl)
end
redis.call('ZADD', KEYS[3], now, ARGV[7])
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

    async def create_character(self, tenant: str, card: Card, max_characters: int = 0) -> Character:
        """Store ``card`` as a new character (:class:`QuotaExceeded` past
        ``max_characters``)."""
        character = Character(f"char_{secrets.token_hex(8)}", int(time.time()), card)
        record = {"id": character.id, "created": character.created, "card": card.to_json()}
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
    ) -> Session:
        """A new session that opens with ``greeting`` from the character
        (:class:`QuotaExceeded` past ``max_sessions`` live ones)."""
        session = Session(
            f"sess_{secrets.token_hex(8)}",
            character.id,
            user_name,
            int(time.time()),
            "",
            [{"role": "assistant", "content": greeting}] if greeting else [],
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
            raise NotFound(
                f"No session with id {session_id!r}.",
                param="session_id",
                code="session_not_found",
            )
        text = {k.decode(): v.decode() for k, v in fields.items()}
        return Session(
            session_id,
            text["character_id"],
            text["user_name"],
            int(text["created"]),
            text.get("last_worker", ""),
            [json.loads(t) for t in turns],
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
        self, tenant: str, session_id: str, user: str, reply: str, worker_id: str
    ) -> bool:
        """Append a completed exchange; False if the session was deleted meanwhile."""
        done = await self._append(
            keys=[
                self._keys.session(tenant, session_id),
                self._keys.session_turns(tenant, session_id),
                self._keys.sessions(tenant),
            ],
            args=[
                json.dumps({"role": "user", "content": user}),
                json.dumps({"role": "assistant", "content": reply}),
                worker_id,
                int(time.time()),
                self._max_messages,
                self._session_ttl_ms,
                session_id,
                now_ms(),
            ],
        )
        return bool(done)
