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
from cluster.wire.keys import Keys
from gateway.http.errors import NotFound


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


# Append both turns only if the session still exists (a deleted session stays deleted).
_APPEND = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[1], 'last_worker', ARGV[3], 'updated', ARGV[4])
return 1
"""


class CharacterStore:
    """Characters and sessions of every tenant."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys
        self._append = redis.register_script(_APPEND)

    async def create_character(self, tenant: str, card: Card) -> Character:
        """Store ``card`` as a new character."""
        character = Character(f"char_{secrets.token_hex(8)}", int(time.time()), card)
        record = {"id": character.id, "created": character.created, "card": card.to_json()}
        await self._redis.hset(self._keys.characters(tenant), character.id, json.dumps(record))
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

    async def characters(self, tenant: str) -> list[Character]:
        """Every character of the tenant, oldest first."""
        raw = await self._redis.hvals(self._keys.characters(tenant))
        records = sorted((json.loads(r) for r in raw), key=lambda r: (r["created"], r["id"]))
        return [Character(r["id"], r["created"], parse_card_json(r["card"])) for r in records]

    async def delete_character(self, tenant: str, character_id: str) -> bool:
        """Delete a character (its sessions stay readable but can no longer chat)."""
        return bool(await self._redis.hdel(self._keys.characters(tenant), character_id))

    async def create_session(
        self, tenant: str, character: Character, user_name: str, greeting: str
    ) -> Session:
        """A new session that opens with ``greeting`` from the character."""
        session = Session(
            f"sess_{secrets.token_hex(8)}",
            character.id,
            user_name,
            int(time.time()),
            "",
            [{"role": "assistant", "content": greeting}] if greeting else [],
        )
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                self._keys.session(tenant, session.id),
                mapping={
                    "character_id": character.id,
                    "user_name": user_name,
                    "created": session.created,
                    "last_worker": "",
                },
            )
            if session.messages:
                pipe.rpush(
                    self._keys.session_turns(tenant, session.id),
                    *(json.dumps(m) for m in session.messages),
                )
            await pipe.execute()
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
        removed = await self._redis.delete(
            self._keys.session(tenant, session_id), self._keys.session_turns(tenant, session_id)
        )
        return bool(removed)

    async def append_turn(
        self, tenant: str, session_id: str, user: str, reply: str, worker_id: str
    ) -> bool:
        """Append a completed exchange; False if the session was deleted meanwhile."""
        done = await self._append(
            keys=[
                self._keys.session(tenant, session_id),
                self._keys.session_turns(tenant, session_id),
            ],
            args=[
                json.dumps({"role": "user", "content": user}),
                json.dumps({"role": "assistant", "content": reply}),
                worker_id,
                int(time.time()),
            ],
        )
        return bool(done)
