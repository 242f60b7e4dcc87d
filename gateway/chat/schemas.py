"""OpenAI Chat Completions request and response shapes.

Requests accept unknown fields (frontends send extra samplers): known vLLM samplers are
typed here so a wrong type is a 400 before anything is queued; other extras pass through
to the worker, which hands vLLM the ones it understands.

The response models and ``*_RESPONSES`` / ``*_EXTRA`` tables at the end only document the
routes in the OpenAPI document (``responses=`` and ``openapi_extra=`` of the route
decorators); handlers build their bodies themselves.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from cluster.wire.protocol import SAMPLING_FIELDS
from cluster.wire.vocabulary import PriorityClass
from gateway.http.openapi import ERROR_RESPONSES, error_responses, ok

# Bounds on the lists a request may send: vLLM checks every stop string and bad word at
# every token, and walks logit_bias and allowed_token_ids at every step, so their sizes
# are the sampler's cost for everyone batched with the request.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256
MAX_BAD_WORDS = 256
MAX_LOGIT_BIAS = 300  # OpenAI's own bound
MAX_ALLOWED_TOKEN_IDS = 10_000


class TextPart(BaseModel):
    """A text content part."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of the conversation."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text, with content parts joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    """``stream_options``."""

    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions`` body."""

    model_config = ConfigDict(
        extra="allow",
        strict=True,
        json_schema_extra={
            "examples": [
                {
                    "model": "smollm2-135m-instruct",
                    "messages": [
                        {"role": "system", "content": "You are Captain Mira Vance."},
                        {"role": "user", "content": "Introduce yourself."},
                    ],
                    "max_tokens": 8,
                }
            ]
        },
    )

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stop: str | list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]] | None = Field(
        default=None, max_length=MAX_STOP_STRINGS
    )
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None
    # vLLM's extra samplers.
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    spaces_between_special_tokens: bool | None = None
    allowed_token_ids: list[int] | None = Field(
        default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS
    )
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None = Field(
        default=None, max_length=MAX_BAD_WORDS
    )

    @model_validator(mode="after")
    def _carriable(self) -> ChatCompletionRequest:
        """400, not a 500 later, for what the job cannot carry: an integer beyond 64 bits
        (msgpack), text with a lone surrogate (UTF-8, the tokenizer), a logit_bias key
        that looks like a token id but is not one."""
        found = _uncarriable(self, "")
        for key in self.logit_bias or {}:
            digits = key.removeprefix("-")
            if found is None and digits.isdigit():  # the others are refused by the route
                if not digits.isascii() or not _INT_MIN <= int(key) <= _INT_MAX:
                    found = ("logit_bias", f"{key!r} is not a token id")
        if found is not None:
            param, why = found
            raise PydanticCustomError("invalid_value", why, {"param": param})
        return self

    def sampling(self) -> dict[str, Any]:
        """The sampling fields the job carries: the typed ones that were set, and nothing
        else (a job holds only what the engine uses)."""
        out: dict[str, Any] = {
            f: getattr(self, f)
            for f in SAMPLING_FIELDS
            if f not in ("stop", "logit_bias") and getattr(self, f, None) is not None
        }
        if self.stop is not None:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.logit_bias:
            out["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        return out

    @property
    def include_usage(self) -> bool:
        """True when the client asked for a final usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what msgpack carries
_SURROGATE = re.compile("[\ud800-\udfff]")


def _uncarriable(value: Any, path: str) -> tuple[str, str] | None:
    """The first place in ``value`` that a job cannot carry, and why."""
    if isinstance(value, BaseModel):
        # Its fields and extras; not dict(value), which an extra named "keys" breaks.
        value = {**value.__dict__, **(value.model_extra or {})}
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            found = _uncarriable(key, where) or _uncarriable(item, where)
            if found:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _uncarriable(item, f"{path}.{index}")
            if found:
                return found
    elif isinstance(value, str):
        if _SURROGATE.search(value):
            return path, "text must be valid Unicode (this holds a lone surrogate)"
    elif isinstance(value, int) and not isinstance(value, bool):
        if not _INT_MIN <= value <= _INT_MAX:
            return path, "integers must fit in 64 bits"
    return None


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


class Choice(BaseModel):
    """The one choice of a non-streamed completion."""

    index: int
    message: AssistantMessage
    logprobs: None
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
    logprobs: None
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
