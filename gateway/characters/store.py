"""Characters and sessions: stored per tenant in Redis, served under ``/v1``.

- A character is an imported card (:mod:`cluster.characters.cards`), stored verbatim so unknown
  fields and ``extensions`` survive a round trip.
- A session binds a character to a user name and holds the conversation. A chat request
  with ``session_id`` and one user message is answered in character
  (:mod:`cluster.characters.persona` assembles the prompt); both turns are appended, atomically, only
  when the reply completes. The session remembers the worker that served its last turn,
  so the next turn can go back to the replica whose prefix cache holds the conversation.

Layout (all under the namespace, per tenant, so one tenant never sees another's):
``characters:{tenant}`` hash id -> JSON record; ``session:{tenant}:{id}`` hash of the
session's fields; ``session-turns:{tenant}:{id}`` list of JSON messages.
"""

from __future__ import annotations

import json
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from cluster.characters.cards import Card, CardError, parse_card, parse_card_json
from cluster.characters.persona import PromptTooLong, assemble, render_greeting
from cluster.wire.keys import Keys
from gateway.chat.schemas import (
    CHARACTER_CREATE_EXTRA,
    CHARACTER_CREATE_RESPONSES,
    CHARACTER_DELETE_RESPONSES,
    CHARACTER_LIST_RESPONSES,
    CHARACTER_RESPONSES,
    SESSION_CREATE_RESPONSES,
    SESSION_DELETE_RESPONSES,
    SESSION_RESPONSES,
    ChatCompletionRequest,
)
from gateway.http.errors import APIError, BadRequest, NotFound


class CardRejected(APIError):
    """A card that cannot be imported (400, or 413 when too large)."""

    type = "invalid_request_error"

    def __init__(self, exc: CardError) -> None:
        super().__init__(exc.message, param=exc.param, code=exc.code)
        self.status = 413 if exc.code == "card_too_large" else 400


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
        record = json.loads(raw)
        return Character(record["id"], record["created"], parse_card_json(record["card"]))

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


@dataclass(frozen=True, slots=True)
class PersonaTurn:
    """A chat request answered in character: its messages, where it should run, and
    what to record when the reply completes."""

    messages: list[dict[str, str]]
    tenant: str
    character_id: str
    session_id: str | None
    user_text: str
    prefer: str | None
    dropped: int


class PersonaChat:
    """Turns a request with ``session_id`` (or ``character_id``) into a persona prompt."""

    def __init__(
        self,
        store: CharacterStore,
        count_tokens: Callable[[list[dict[str, str]]], int],
        max_model_len: int,
        default_system_prompt: str = "",
        affinity: bool = True,
    ) -> None:
        self._store = store
        self._count = count_tokens
        self._max_model_len = max_model_len
        self._default_system = default_system_prompt
        self._affinity = affinity

    async def resolve(
        self,
        request: ChatCompletionRequest,
        tenant: str,
        max_tokens: int,
        free_by_worker: dict[str, int],
    ) -> PersonaTurn | None:
        """The persona turn for ``request``, or None for a plain OpenAI request."""
        extra = request.model_extra or {}
        session_id, character_id = extra.get("session_id"), extra.get("character_id")
        if session_id is None and character_id is None:
            return None
        for name, value in (("session_id", session_id), ("character_id", character_id)):
            if value is not None and (not isinstance(value, str) or not value):
                raise BadRequest(f"{name} must be a non-empty string", param=name)
        session: Session | None = None
        if isinstance(session_id, str):
            last = request.messages[-1] if request.messages else None
            if len(request.messages) != 1 or last is None or last.role != "user":
                raise BadRequest(
                    "a session turn is exactly one user message; the session holds the history",
                    param="messages",
                )
            session = await self._store.session(tenant, session_id)
            character = await self._store.character(tenant, session.character_id)
            history = [*session.messages, {"role": "user", "content": last.text()}]
            user_name = session.user_name
        else:
            character = await self._store.character(tenant, str(character_id))
            history = [{"role": m.role, "content": m.text()} for m in request.messages]
            user_name = str(extra.get("user_name") or request.user or "User")
        try:
            assembled = assemble(
                character.card,
                history,
                user_name=user_name,
                default_system_prompt=self._default_system,
                count_tokens=self._count,
                max_prompt_tokens=self._max_model_len - max_tokens,
            )
        except PromptTooLong as exc:
            raise BadRequest(
                f"This model's maximum context length is {self._max_model_len} tokens; the "
                f"character's persona and the latest message alone need {exc.prompt_tokens} "
                f"tokens with {max_tokens} for the reply.",
                param="messages",
                code="context_length_exceeded",
            ) from exc
        prefer = None
        if self._affinity:
            candidates = [session.last_worker] if session and session.last_worker else []
            if not candidates:
                candidates = [await self._store.character_worker(tenant, character.id)]
            # Only a live worker with room: an overloaded or vanished one is not waited for.
            prefer = next((w for w in candidates if free_by_worker.get(w, 0) > 0), None)
        return PersonaTurn(
            messages=assembled.messages,
            tenant=tenant,
            character_id=character.id,
            session_id=session.id if session else None,
            user_text=history[-1]["content"],
            prefer=prefer,
            dropped=assembled.dropped,
        )

    async def completed(self, turn: PersonaTurn, reply: str, worker_id: str) -> None:
        """Record a completed reply: both turns into the session, and where it ran."""
        if turn.session_id is not None:
            await self._store.append_turn(
                turn.tenant, turn.session_id, turn.user_text, reply, worker_id
            )
        if worker_id:
            await self._store.note_character_worker(turn.tenant, turn.character_id, worker_id)


class SessionCreate(BaseModel):
    """``POST /v1/sessions``."""

    model_config = ConfigDict(extra="forbid")

    character_id: str = Field(min_length=1, max_length=64)
    user_name: str = Field(default="User", min_length=1, max_length=128)
    greeting_index: int | None = Field(
        default=None, ge=0, description="0 = first_mes (the default), n = alternate greeting n."
    )
    random_greeting: bool = Field(
        default=False, description="Open with a greeting picked at random (a 'swipe')."
    )


MAX_CARD_UPLOAD_BYTES = 8 * 1024 * 1024


def router() -> APIRouter:
    """The ``/v1/characters`` and ``/v1/sessions`` routes."""
    api = APIRouter()

    def store(request: Request) -> CharacterStore:
        return request.app.state.characters  # type: ignore[no-any-return]

    @api.post(
        "/v1/characters",
        responses=CHARACTER_CREATE_RESPONSES,
        openapi_extra=CHARACTER_CREATE_EXTRA,
    )
    async def create_character(request: Request) -> dict[str, Any]:
        """Import a card: a JSON body, a PNG body, or a multipart form with ``file``."""
        content_type = request.headers.get("content-type", "")
        if content_type.startswith("multipart/form-data"):
            form = await request.form(max_files=1, max_fields=4)
            upload = form.get("file")
            if upload is None or isinstance(upload, str):
                raise BadRequest("send the card as a form file named 'file'", param="file")
            data = await upload.read(MAX_CARD_UPLOAD_BYTES + 1)
            content_type = upload.content_type or ""
        else:
            data = await request.body()
        try:
            card = parse_card(data, content_type)
        except CardError as exc:
            raise CardRejected(exc) from exc
        character = await store(request).create_character(request.state.tenant, card)
        return character.body()

    @api.get("/v1/characters", responses=CHARACTER_LIST_RESPONSES)
    async def list_characters(request: Request) -> dict[str, Any]:
        """The tenant's characters."""
        found = await store(request).characters(request.state.tenant)
        return {"object": "list", "data": [c.summary() for c in found]}

    @api.get("/v1/characters/{character_id}", responses=CHARACTER_RESPONSES)
    async def get_character(character_id: str, request: Request) -> dict[str, Any]:
        """One character with its card."""
        return (await store(request).character(request.state.tenant, character_id)).body()

    @api.delete("/v1/characters/{character_id}", responses=CHARACTER_DELETE_RESPONSES)
    async def delete_character(character_id: str, request: Request) -> dict[str, Any]:
        """Delete a character."""
        if not await store(request).delete_character(request.state.tenant, character_id):
            raise NotFound(f"No character with id {character_id!r}.", code="character_not_found")
        return {"id": character_id, "object": "character.deleted", "deleted": True}

    @api.post("/v1/sessions", responses=SESSION_CREATE_RESPONSES)
    async def create_session(body: SessionCreate, request: Request) -> dict[str, Any]:
        """Start a conversation; the reply carries the character's greeting."""
        tenant = request.state.tenant
        characters = store(request)
        character = await characters.character(tenant, body.character_id)
        try:
            greeting = render_greeting(
                character.card,
                user_name=body.user_name,
                index=body.greeting_index,
                rng=random.Random() if body.random_greeting else None,
            )
        except CardError as exc:
            raise BadRequest(exc.message, param="greeting_index") from exc
        session = await characters.create_session(tenant, character, body.user_name, greeting)
        return {**session.body(), "greeting": greeting}

    @api.get("/v1/sessions/{session_id}", responses=SESSION_RESPONSES)
    async def get_session(session_id: str, request: Request) -> dict[str, Any]:
        """A session and its conversation."""
        return (await store(request).session(request.state.tenant, session_id)).body()

    @api.delete("/v1/sessions/{session_id}", responses=SESSION_DELETE_RESPONSES)
    async def delete_session(session_id: str, request: Request) -> dict[str, Any]:
        """Delete a session."""
        if not await store(request).delete_session(request.state.tenant, session_id):
            raise NotFound(f"No session with id {session_id!r}.", code="session_not_found")
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    return api
