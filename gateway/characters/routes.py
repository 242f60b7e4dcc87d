"""``/v1/characters`` and ``/v1/sessions``: import, list, read and delete characters;
start, read and delete sessions (a session's turns are chat requests with ``session_id``,
see :mod:`gateway.characters.persona_chat`)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from cluster.characters.cards import CardError, parse_card
from cluster.characters.persona import render_greeting
from gateway.characters.schemas import (
    CHARACTER_CREATE_EXTRA,
    CHARACTER_CREATE_RESPONSES,
    CHARACTER_DELETE_RESPONSES,
    CHARACTER_LIST_RESPONSES,
    CHARACTER_RESPONSES,
    SESSION_CREATE_RESPONSES,
    SESSION_DELETE_RESPONSES,
    SESSION_RESPONSES,
)
from gateway.characters.store import CharacterStore
from gateway.http.context import tenant as tenant_of
from gateway.http.errors import APIError, BadRequest, NotFound
from gateway.services import services


class CardRejected(APIError):
    """A card that cannot be imported (400, or 413 when too large)."""

    type = "invalid_request_error"

    def __init__(self, exc: CardError) -> None:
        super().__init__(exc.message, param=exc.param, code=exc.code)
        self.status = 413 if exc.code == "card_too_large" else 400


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
        return services(request).characters

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
            # Off the event loop: a card is up to 2 MiB of JSON (8 MiB as a PNG).
            card = await asyncio.to_thread(parse_card, data, content_type)
        except CardError as exc:
            raise CardRejected(exc) from exc
        tenant = tenant_of(request)
        limits = await services(request).auth.limits(tenant)
        character = await store(request).create_character(tenant, card, limits.max_characters)
        return character.body()

    @api.get("/v1/characters", responses=CHARACTER_LIST_RESPONSES)
    async def list_characters(request: Request) -> dict[str, Any]:
        """The tenant's characters."""
        found = await store(request).summaries(tenant_of(request))
        return {"object": "list", "data": found}

    @api.get("/v1/characters/{character_id}", responses=CHARACTER_RESPONSES)
    async def get_character(character_id: str, request: Request) -> dict[str, Any]:
        """One character with its card."""
        return (await store(request).character(tenant_of(request), character_id)).body()

    @api.delete("/v1/characters/{character_id}", responses=CHARACTER_DELETE_RESPONSES)
    async def delete_character(character_id: str, request: Request) -> dict[str, Any]:
        """Delete a character."""
        if not await store(request).delete_character(tenant_of(request), character_id):
            raise NotFound(f"No character with id {character_id!r}.", code="character_not_found")
        return {"id": character_id, "object": "character.deleted", "deleted": True}

    @api.post("/v1/sessions", responses=SESSION_CREATE_RESPONSES)
    async def create_session(body: SessionCreate, request: Request) -> dict[str, Any]:
        """Start a conversation; the reply carries the character's greeting."""
        tenant = tenant_of(request)
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
        limits = await services(request).auth.limits(tenant)
        session = await characters.create_session(
            tenant, character, body.user_name, greeting, limits.max_sessions
        )
        return {**session.body(), "greeting": greeting}

    @api.get("/v1/sessions/{session_id}", responses=SESSION_RESPONSES)
    async def get_session(session_id: str, request: Request) -> dict[str, Any]:
        """A session and its conversation."""
        return (await store(request).session(tenant_of(request), session_id)).body()

    @api.delete("/v1/sessions/{session_id}", responses=SESSION_DELETE_RESPONSES)
    async def delete_session(session_id: str, request: Request) -> dict[str, Any]:
        """Delete a session."""
        if not await store(request).delete_session(tenant_of(request), session_id):
            raise NotFound(f"No session with id {session_id!r}.", code="session_not_found")
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    return api
