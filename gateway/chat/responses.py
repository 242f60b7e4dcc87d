"""OpenAI chat and text completion response shapes, for the OpenAPI document.

The response models and ``*_RESPONSES`` / ``*_EXTRA`` tables only document the routes
(``responses=`` and ``openapi_extra=`` of the route decorators); handlers build their
bodies themselves (:mod:`gateway.streaming.sse`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from cluster.wire.vocabulary import PriorityClass
from gateway.http.openapi import ERROR_RESPONSES, error_responses, ok

# Response shapes, for the OpenAPI document.

FinishReason = Literal["stop", "length", "content_filter", "tool_calls"]


class PromptTokensDetails(BaseModel):
    """``usage.prompt_tokens_details``."""

    cached_tokens: int


class Usage(BaseModel):
    """Token counts of a reply."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    """The reply of a non-streamed completion."""

    role: Literal["assistant"]
    content: str
    refusal: None


class TopLogprob(BaseModel):
    """One alternative for a token."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    """A token's logprob and its best alternatives."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's ``logprobs`` (when the request asked for them)."""

    content: list[TokenLogprob] | None
    refusal: None = None


class TextLogprobs(BaseModel):
    """A text completion choice's ``logprobs``, in the legacy completions shape."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class Choice(BaseModel):
    """The one choice of a non-streamed completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    """A non-streamed ``chat.completion``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[Choice]
    usage: Usage


class Delta(BaseModel):
    """What a chunk adds to the reply (the role only in the first)."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    """The choice of a streamed chunk."""

    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    """One ``chat.completion.chunk`` of a stream (the data of an SSE event)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[ChunkChoice]
    usage: Usage | None = None


SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "description": "One server-sent event: data is a chat.completion.chunk as JSON, an error "
    "body as JSON (then [DONE]), or [DONE]; id (only for a resumable request, one sent with "
    "X-Event-Ids: true, and on the resume route) is the chunk sequence, for Last-Event-ID.",
    "required": ["data"],
    "properties": {
        "data": {"type": "string"},
        "id": {"type": "string", "pattern": "^[0-9]+$"},
        "event": {"const": "message"},
    },
}


class ModelCard(BaseModel):
    """A served model."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    # A LoRA adapter's base model (vLLM's listing); None for the base model itself.
    parent: str | None = None


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"]
    data: list[ModelCard]


# ``responses=`` of each route. Errors every route can meet at the edge (401, 413, 500,
# 503) are added by gateway.http.errors.document_errors.
CHAT_COMPLETION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "model": ChatCompletion,
        "description": "The reply: one chat.completion, or with stream=true a text/event-stream "
        "of chat.completion.chunk events ending with [DONE].",
        "content": {"text/event-stream": {"itemSchema": SSE_EVENT}},
    },
    **ERROR_RESPONSES,
}


class TextChoice(BaseModel):
    """The one choice of a text completion."""

    index: int
    text: str
    logprobs: TextLogprobs | None
    finish_reason: FinishReason | None


class TextCompletion(BaseModel):
    """A ``text_completion`` (whole, or one chunk of a stream)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[TextChoice]
    usage: Usage | None = None


TEXT_COMPLETION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "model": TextCompletion,
        "description": "The completion: one text_completion, or with stream=true a "
        "text/event-stream of text_completion chunks ending with [DONE].",
        "content": {"text/event-stream": {"itemSchema": SSE_EVENT}},
    },
    **ERROR_RESPONSES,
}
CHAT_EVENTS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The events after Last-Event-ID, replayed from the log, then live.",
        "content": {"text/event-stream": {"itemSchema": SSE_EVENT}},
    },
    **error_responses(400, 404),
}
MODELS_RESPONSES = ok(ModelList, "The served model.")


def _header(name: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "in": "header",
        "name": name,
        "required": False,
        "description": description,
        "schema": schema,
    }


# ``openapi_extra=`` of routes that read headers or a raw body themselves.
CHAT_COMPLETION_EXTRA: dict[str, Any] = {
    "parameters": [
        _header(
            "X-Priority",
            "Admission class (default interactive).",
            {"type": "string", "enum": [c.value for c in PriorityClass]},
        ),
        _header(
            "X-Latency-Budget-Ms",
            "Time-to-first-token budget in ms, instead of the class's.",
            {"type": "integer", "minimum": 1},
        ),
        _header(
            "X-Resumable",
            "true: keep generating when the client disconnects, so it can resume; the "
            "events carry id: lines for Last-Event-ID.",
            {"type": "string", "enum": ["true", "false"]},
        ),
        _header(
            "X-Event-Ids",
            "true: events carry id: lines (the chunk sequence) for Last-Event-ID; by "
            "default a stream is framed exactly as OpenAI frames it, without them.",
            {"type": "string", "enum": ["true", "false"]},
        ),
    ]
}
CHAT_EVENTS_EXTRA: dict[str, Any] = {
    "parameters": [
        _header(
            "Last-Event-ID",
            "Replay the events after this chunk sequence (default: from the start).",
            {"type": "string", "pattern": "^[0-9]*$"},
        )
    ]
}
