"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, and ``GET /v1/models/{id}``.

Frontends count tokens to budget a context: ``/tokenize`` of chat messages renders them
with the same template and options as a chat request and counts exactly what admission
counts. Both routes need a key, as ``/v1`` does, and are bounded as a chat's prompt is;
long texts are tokenized off the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from gateway.chat.admission import check_model
from gateway.chat.prompts import (
    ON_LOOP_CHARS,
    PromptBuilder,
    TemplateOptions,
    prompt_chars,
    template_messages,
)
from gateway.chat.responses import ModelCard
from gateway.chat.schemas import ChatMessage, template_contradiction
from gateway.http.errors import BadRequest
from gateway.http.openapi import error_responses, ok
from gateway.services import services


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize`` body: a ``prompt`` (completion style), or chat ``messages``
    rendered with the model's template."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=16)
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    """vLLM's ``/tokenize`` answer."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """vLLM's ``/detokenize`` body."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=1_000_000)


class DetokenizeResponse(BaseModel):
    """vLLM's ``/detokenize`` answer."""

    prompt: str


def model_card(name: str, max_model_len: int, parent: str | None = None) -> dict[str, Any]:
    """A served model as OpenAI describes a model (with vLLM's ``max_model_len``); a LoRA
    adapter has the base model as its ``parent``, as vLLM lists it."""
    card: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "charserve",
        "max_model_len": max_model_len,
    }
    if parent is not None:
        card["parent"] = parent
    return card


def model_cards(request: Request) -> list[dict[str, Any]]:
    """The served model, then the LoRA adapters some live replica serves, by name."""
    s = services(request)
    base, length = s.settings.served_model_name, s.settings.max_model_len
    adapters = sorted(s.capacity.current.adapters)
    return [model_card(base, length), *(model_card(a, length, base) for a in adapters)]


def _check_model(request: Request, model: str | None) -> None:
    s = services(request)
    if model is not None:
        check_model(s.settings.served_model_name, s.capacity.current.adapters, model)


async def tokenize(prompts: PromptBuilder, body: TokenizeRequest, max_messages: int) -> list[int]:
    """The token ids ``body`` asks for: its messages as the chat route renders them (the
    count admission charges), or its prompt."""
    if (body.prompt is None) == (body.messages is None):
        raise BadRequest("give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        contradiction = template_contradiction(
            body.add_generation_prompt, body.continue_final_message, body.messages[-1].role
        )
        if contradiction is not None:
            raise BadRequest(contradiction[1], param=contradiction[0])
        if body.add_special_tokens:
            raise BadRequest(
                "add_special_tokens is for prompts: the chat template places its own",
                param="add_special_tokens",
            )
        if len(body.messages) > max_messages:
            raise BadRequest(
                f"at most {max_messages} messages are accepted, got {len(body.messages)}",
                param="messages",
                code="too_many_messages",
            )
        messages = template_messages(body.messages)
        chars = prompt_chars(messages)
        prompts.check_chars(chars, "messages")
        options = TemplateOptions.checked(
            body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs
        )
        if chars <= ON_LOOP_CHARS:
            return prompts.encode(messages, options)
        return await asyncio.to_thread(prompts.encode, messages, options)
    text = body.prompt or ""
    prompts.check_chars(len(text), "prompt")
    special = True if body.add_special_tokens is None else body.add_special_tokens
    if len(text) <= ON_LOOP_CHARS:
        return prompts.encode_text(text, special)
    return await asyncio.to_thread(prompts.encode_text, text, special)


def router() -> APIRouter:
    """The token routes and the model route."""
    api = APIRouter()

    @api.post(
        "/tokenize", responses={**ok(TokenizeResponse, "The tokens."), **error_responses(400, 404)}
    )
    async def tokenize_route(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        """Token ids of a prompt or of chat messages (vLLM's route)."""
        _check_model(request, body.model)
        prompts = services(request).prompts
        tokens = await tokenize(prompts, body, services(request).settings.max_messages)
        strs = prompts.token_strs(tokens) if body.return_token_strs else None
        return {
            "count": len(tokens),
            "max_model_len": prompts.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }

    @api.post(
        "/detokenize",
        responses={**ok(DetokenizeResponse, "The text."), **error_responses(400, 404)},
    )
    async def detokenize_route(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        """The text of token ids (vLLM's route)."""
        _check_model(request, body.model)
        prompts = services(request).prompts
        if any(t >= prompts.vocab_size for t in body.tokens):
            bad = next(t for t in body.tokens if t >= prompts.vocab_size)
            raise BadRequest(f"{bad} is not a token id of this model", param="tokens")
        if len(body.tokens) <= ON_LOOP_CHARS // 4:
            return {"prompt": prompts.decode(body.tokens)}
        return {"prompt": await asyncio.to_thread(prompts.decode, body.tokens)}

    @api.get(
        "/v1/models/{model_id}",
        responses={**ok(ModelCard, "The model."), **error_responses(404)},
    )
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        """One served model or LoRA adapter (the openai client's ``models.retrieve``)."""
        _check_model(request, model_id)
        return next(card for card in model_cards(request) if card["id"] == model_id)

    return api
