"""Response shapes of ``/v1/characters`` and ``/v1/sessions``, for the OpenAPI document
(``responses=`` and ``openapi_extra=`` of the routes; handlers build their bodies)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from cluster.wire.vocabulary import ADAPTER_NAME_PATTERN
from gateway.http.openapi import error_responses, ok


class CharacterSummary(BaseModel):
    """A character in a listing."""

    id: str
    object: Literal["character"]
    created: int
    name: str
    spec: Literal["chara_card_v1", "chara_card_v2", "chara_card_v3"]
    adapter: str | None = Field(
        default=None,
        description="The LoRA adapter the character's turns run with (absent: the base model).",
    )


class CharacterBody(CharacterSummary):
    """A character with its card document exactly as imported."""

    card: dict[str, Any]


class CharacterList(BaseModel):
    """``GET /v1/characters``."""

    object: Literal["list"]
    data: list[CharacterSummary]


class SessionMessage(BaseModel):
    """One turn of a session; a swiped reply also lists its alternatives."""

    role: Literal["user", "assistant"]
    content: str
    swipes: list[str] | None = None
    swipe_id: int | None = None
    name: str | None = Field(default=None, description="A group chat's speaker.")
    character_id: str | None = None


class SessionMemory(BaseModel):
    """A long session's summary of its oldest turns."""

    summary: str
    covers: int = Field(description="The messages it covers: the first this many.")


class SessionBody(BaseModel):
    """A session and its conversation."""

    id: str
    object: Literal["session"]
    created: int
    character_id: str
    user_name: str
    messages: list[SessionMessage]
    character_ids: list[str] | None = Field(default=None, description="A group's members.")
    memory: SessionMemory | None = None


class SessionCreated(SessionBody):
    """A new session, with the greeting it opened with."""

    greeting: str


class SessionWarm(BaseModel):
    """``POST /v1/sessions/{id}/warm``: the conversation is in the engine's cache."""

    id: str
    object: Literal["session.warm"]
    prompt_tokens: int
    cached_tokens: int = Field(description="Of them, those the cache held already.")


class Deleted(BaseModel):
    """A deleted character or session."""

    id: str
    object: Literal["character.deleted", "session.deleted"]
    deleted: Literal[True]


CHARACTER_CREATE_RESPONSES = {**ok(CharacterBody, "The new character."), **error_responses(400)}
CHARACTER_LIST_RESPONSES = ok(CharacterList, "The tenant's characters, oldest first.")
CHARACTER_RESPONSES = {**ok(CharacterBody, "The character."), **error_responses(404)}
CHARACTER_DELETE_RESPONSES = {**ok(Deleted, "Deleted."), **error_responses(404)}
SESSION_CREATE_RESPONSES = {
    **ok(SessionCreated, "The new session, opened with the greeting."),
    **error_responses(400, 404),
}
SESSION_RESPONSES = {
    **ok(SessionBody, "The session and its conversation."),
    **error_responses(404),
}
SESSION_DELETE_RESPONSES = {**ok(Deleted, "Deleted."), **error_responses(404)}
SESSION_MESSAGE_RESPONSES = {
    **ok(SessionMessage, "The message as now stored."),
    **error_responses(400, 404),
}
SESSION_MESSAGE_DELETE_RESPONSES = {
    **ok(SessionBody, "The session after the deletion."),
    **error_responses(400, 404),
}
SESSION_WARM_RESPONSES = {
    **ok(SessionWarm, "Prefilled."),
    **error_responses(400, 404, 429, 503, 504),
}
SESSION_BRANCH_RESPONSES = {
    **ok(SessionBody, "The new session, holding the first messages of the other."),
    **error_responses(400, 404, 429),
}

CHARACTER_CREATE_EXTRA: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "A Character Card V1, V2 or V3: JSON, a PNG with a chara or ccv3 "
        "tEXt chunk, or a multipart form whose file is either.",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "image/png": {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {"file": {"type": "string", "format": "binary"}},
                }
            },
        },
    },
    "parameters": [
        {
            "name": "adapter",
            "in": "query",
            "required": False,
            "description": "A LoRA adapter the character's turns run with, by the model name "
            "replicas serve it under (GET /v1/models lists them).",
            "schema": {"type": "string", "pattern": f"^{ADAPTER_NAME_PATTERN}$"},
        }
    ],
}
