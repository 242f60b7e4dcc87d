"""``/v1/characters`` and ``/v1/sessions``: import, list, read and delete characters;
start, read and delete sessions (a session's turns are chat requests with ``session_id``,
see :mod:`gateway.characters.persona_chat`); swipe, continue and impersonate in a session
(chat requests by another route); edit or delete a message; branch a session."""

from __future__ import annotations

import asyncio
import json
import random
import re
from dataclasses import replace
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cluster.characters.cards import CardError, parse_card
from cluster.characters.persona import render_greeting
from cluster.wire.vocabulary import ADAPTER_NAME_PATTERN, PriorityClass
from gateway.characters.schemas import (
    CHARACTER_CREATE_EXTRA,
    CHARACTER_CREATE_RESPONSES,
    CHARACTER_DELETE_RESPONSES,
    CHARACTER_LIST_RESPONSES,
    CHARACTER_RESPONSES,
    SESSION_BRANCH_RESPONSES,
    SESSION_CREATE_RESPONSES,
    SESSION_DELETE_RESPONSES,
    SESSION_MESSAGE_DELETE_RESPONSES,
    SESSION_MESSAGE_RESPONSES,
    SESSION_RESPONSES,
    SESSION_WARM_RESPONSES,
)
from gateway.characters.store import CharacterStore
from gateway.chat.admission import classify
from gateway.chat.responses import CHAT_COMPLETION_RESPONSES
from gateway.chat.routes import chat_context
from gateway.chat.schemas import ChatCompletionRequest, SessionAction
from gateway.chat.service import whole_reply
from gateway.http.context import tenant as tenant_of
from gateway.http.errors import APIError, BadRequest, NotFound
from gateway.http.openapi import error_responses
from gateway.services import services


class CardRejected(APIError):
    """A card that cannot be imported (400, or 413 when too large)."""

    type = "invalid_request_error"

    def __init__(self, exc: CardError) -> None:
        super().__init__(exc.message, param=exc.param, code=exc.code)
        self.status = 413 if exc.code == "card_too_large" else 400


MAX_GROUP = 8


class SessionCreate(BaseModel):
    """``POST /v1/sessions``: one character, or a group of them."""

    model_config = ConfigDict(extra="forbid")

    character_id: str | None = Field(default=None, min_length=1, max_length=64)
    character_ids: list[Annotated[str, Field(min_length=1, max_length=64)]] | None = Field(
        default=None,
        min_length=2,
        max_length=MAX_GROUP,
        description="A group chat: its characters, in order; the first greets.",
    )
    user_name: str = Field(default="User", min_length=1, max_length=128)
    greeting_index: int | None = Field(
        default=None, ge=0, description="0 = first_mes (the default), n = alternate greeting n."
    )
    random_greeting: bool = Field(
        default=False, description="Open with a greeting picked at random (a 'swipe')."
    )

    @model_validator(mode="after")
    def _one_or_a_group(self) -> SessionCreate:
        if (self.character_id is None) == (self.character_ids is None):
            raise ValueError("give either character_id or character_ids")
        if self.character_ids is not None and len(set(self.character_ids)) != len(
            self.character_ids
        ):
            raise ValueError("character_ids: each character once")
        return self


MAX_MESSAGE_CHARS = 100_000


class MessageEdit(BaseModel):
    """``PATCH /v1/sessions/{id}/messages/{index}``: new text, or another alternative shown."""

    model_config = ConfigDict(extra="forbid", strict=True)

    content: str | None = Field(default=None, max_length=MAX_MESSAGE_CHARS)
    swipe_id: int | None = Field(default=None, ge=0, le=1_000)

    @model_validator(mode="after")
    def _one(self) -> MessageEdit:
        if (self.content is None) == (self.swipe_id is None):
            raise ValueError("give either content or swipe_id")
        return self


class Branch(BaseModel):
    """``POST /v1/sessions/{id}/branch``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    at: int = Field(ge=0, le=100_000, description="Messages kept: the new session's first.")


SessionActionName = Literal["swipe", "continue", "impersonate"]
# Set by the route, not by the body.
_SET_BY_ROUTE = ("messages", "session_id", "session_action", "character_id", "user_name")
MessageIndex = Annotated[int, Path(ge=0, le=100_000)]

MAX_CARD_UPLOAD_BYTES = 8 * 1024 * 1024


def adapter_param(request: Request) -> str:
    """The ``adapter`` query parameter of a character import ('' when absent): the LoRA
    adapter the character speaks through, a name in the shape replicas give adapters."""
    adapter = request.query_params.get("adapter")
    if adapter is None:
        return ""
    if not re.fullmatch(ADAPTER_NAME_PATTERN, adapter):
        raise BadRequest(
            f"adapter must be a LoRA adapter's name ({ADAPTER_NAME_PATTERN}), not {adapter[:80]!r}",
            param="adapter",
        )
    return adapter


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
        character = await store(request).create_character(
            tenant, card, limits.max_characters, adapter_param(request)
        )
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
        ids = body.character_ids or [str(body.character_id)]
        group = tuple(await asyncio.gather(*(characters.character(tenant, cid) for cid in ids)))
        character = group[0]
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
            tenant,
            character,
            body.user_name,
            greeting,
            limits.max_sessions,
            group if body.character_ids else (),
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

    # Before /v1/sessions/{id}/{action}, which would otherwise take "branch" as an action.
    @api.post("/v1/sessions/{session_id}/branch", responses=SESSION_BRANCH_RESPONSES)
    async def branch_session(session_id: str, body: Branch, request: Request) -> dict[str, Any]:
        """A new session holding this one's first ``at`` messages, to go another way."""
        tenant = tenant_of(request)
        limits = await services(request).auth.limits(tenant)
        branched = await store(request).branch(tenant, session_id, body.at, limits.max_sessions)
        return branched.body()

    async def session_chat(
        session_id: str, action: SessionAction, request: Request, **forced: Any
    ) -> ChatCompletionRequest:
        """The chat request of a session action: the body's sampling options, the
        session and the action (and ``forced`` values)."""
        raw = await request.body()
        try:
            options = json.loads(raw) if raw.strip() else {}
        except ValueError as exc:
            raise BadRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from exc
        if not isinstance(options, dict):
            raise BadRequest("the body must be a JSON object", code="invalid_json")
        for name in (*_SET_BY_ROUTE, *forced):
            if name in options:
                raise BadRequest(
                    f"{name} is set by the route /v1/sessions/{{id}}/{action}",
                    param=name,
                    code="unsupported_field",
                )
        body = {
            "model": services(request).settings.served_model_name,
            **options,
            **forced,
            "session_id": session_id,
            "session_action": action,
        }
        try:
            return ChatCompletionRequest.model_validate_json(json.dumps(body))
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from exc

    # Before /v1/sessions/{id}/{action}, as branch is.
    @api.post("/v1/sessions/{session_id}/warm", responses=SESSION_WARM_RESPONSES)
    async def warm_session(session_id: str, request: Request) -> Response:
        """Prefill the conversation so far on the replica its next turn prefers, in the
        batch class (``X-Priority`` may say otherwise) within the standard class's budget
        (past it, a warm is of no use). The body may hold sampling options (they do not
        change what is cached) and ``model``."""
        s = services(request)
        chat = await session_chat(session_id, "warm", request, max_tokens=1, stream=False)
        admission = classify(
            s.settings,
            s.clock.now_ms(),
            request.headers.get("x-priority") or PriorityClass.BATCH,
            request.headers.get("x-latency-budget-ms") or str(s.settings.budget_standard_ms),
        )
        done = await s.chat.complete(chat, replace(chat_context(request), admission=admission))
        if done.status_code != 200:
            return done
        usage = whole_reply(done)["usage"]
        return JSONResponse(
            {
                "id": session_id,
                "object": "session.warm",
                "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            },
            headers={k: v for k, v in done.headers.items() if k.startswith("x-ratelimit")},
        )

    @api.post(
        "/v1/sessions/{session_id}/{action}",
        response_model=None,
        responses={**CHAT_COMPLETION_RESPONSES, **error_responses(409)},
    )
    async def session_action(
        session_id: str, action: SessionActionName, request: Request
    ) -> Response:
        """Swipe, continue or impersonate: a chat completion (streamed or not) whose body
        holds only sampling options (``model`` defaults to the served one)."""
        chat = await session_chat(session_id, action, request)
        return await services(request).chat.complete(chat, chat_context(request))

    @api.patch("/v1/sessions/{session_id}/messages/{index}", responses=SESSION_MESSAGE_RESPONSES)
    async def edit_message(
        session_id: str, index: MessageIndex, body: MessageEdit, request: Request
    ) -> dict[str, Any]:
        """Change a message's text, or show another of a reply's alternatives."""
        what = "content" if body.content is not None else "swipe_id"
        value = body.content if body.content is not None else body.swipe_id
        assert value is not None
        stored = await store(request).edit_message(
            tenant_of(request), session_id, index, what, value
        )
        assert stored is not None
        return stored

    @api.delete(
        "/v1/sessions/{session_id}/messages/{index}",
        responses=SESSION_MESSAGE_DELETE_RESPONSES,
    )
    async def delete_message(
        session_id: str, index: MessageIndex, request: Request
    ) -> dict[str, Any]:
        """Delete one message; the session after it."""
        tenant = tenant_of(request)
        await store(request).edit_message(tenant, session_id, index, "delete", "")
        return (await store(request).session(tenant, session_id)).body()

    return api
