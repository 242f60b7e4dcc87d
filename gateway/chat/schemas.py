"""OpenAI Chat Completions request and response shapes.

No field is ignored silently. Every field a request may carry is typed here, so a wrong
type is a 400 before anything is queued; a field of OpenAI's or vLLM's API this server does
not serve (:data:`REFUSED_FIELDS`) is refused with a 400 that names it and says why, unless
it holds its neutral value (``logprobs: false``); any other field is refused as unknown.
docs/api.md lists every field and what happens to it.

The response shapes, for the OpenAPI document, are in :mod:`gateway.chat.responses`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from cluster.wire.protocol import SAMPLING_FIELDS
from gateway.chat.tools import (
    MAX_TOOLS,
    MessageToolCall,
    Tool,
    ToolChoice,
    choice_contradiction,
    constraint,
    effective_choice,
)

# Bounds on the lists a request may send: vLLM checks every stop string and bad word at
# every token, and walks logit_bias and allowed_token_ids at every step, so their sizes
# are the sampler's cost for everyone batched with the request.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256
MAX_BAD_WORDS = 256
MAX_LOGIT_BIAS = 300  # OpenAI's own bound
MAX_ALLOWED_TOKEN_IDS = 10_000
# OpenAI's bounds on the alternatives per token (chat, and the legacy completions API).
MAX_TOP_LOGPROBS = 20
MAX_TEXT_LOGPROBS = 5
# The roleplay samplers (docs/api.md#roleplay-samplers): the engine core checks every banned
# string's token sequences at every step, and a worker turns each breaker and banned string
# into token ids before the job runs.
MAX_SEQUENCE_BREAKERS = 16
MAX_BREAKER_CHARS = 32
MAX_BREAKERS_TEXT = 1024  # text-generation-webui's form: the breakers as one string
MAX_BANNED_STRINGS = 64
MAX_BANNED_CHARS = 256
# DRY counts a match up to 50 tokens (workers.engines.samplers.DRY_MAX_MATCH): a longer
# allowed length could never be reached, and the field would ask for nothing.
MAX_DRY_ALLOWED_LENGTH = 50
MAX_XTC_THRESHOLD = 0.5  # above it no two tokens can both pass: XTC would never act


# OpenAI and vLLM chat fields this server does not serve, and why: a request that sets one
# to anything but its neutral value (``_NEUTRAL``) gets a 400 naming it.
REFUSED_FIELDS: dict[str, str] = {
    "functions": "function calling is not served (and deprecated by OpenAI for tools)",
    "function_call": "function calling is not served (and deprecated by OpenAI for tools)",
    "prompt_logprobs": "log probabilities are not returned by this server yet",
    "suffix": "insertion (a suffix after the completion) is not served by this model",
    "audio": "this model produces text only",
    "modalities": "this model produces text only",
    "prediction": "predicted outputs are not served",
    "reasoning_effort": "this model does not reason",
    "web_search_options": "web search is not served",
    "store": "completions are not stored; nothing reads them back",
    "metadata": "metadata is kept only with stored completions, which are not served",
    "service_tier": "use the X-Priority header for the admission class",
    "use_beam_search": "beam search is not served",
    "best_of": "best_of is not served",
    "length_penalty": "length_penalty applies to beam search, which is not served",
    "prompt_embeds": "prompt embeddings are not accepted",
    "guided_decoding_backend": "the structured-output backend is the server's choice",
    "structural_tag": "structural tags are not served",
    "documents": "documents are not served: this model's template has no RAG section",
    "mm_processor_kwargs": "this model takes text only",
    "truncate_prompt_tokens": "a prompt too long is refused, never cut silently",
    "priority": "use the X-Priority header for the admission class",
    "request_id": "use the X-Request-Id header",
    "cache_salt": "the prefix cache is shared by design; tenants' prompts never leak text",
    "kv_transfer_params": "disaggregated prefill is not served",
    "vllm_xargs": "extra engine arguments are not accepted per request",
    "return_tokens_as_token_ids": "not served",
    "return_token_ids": "not served",
    "chat_template": "the chat template is the model's own; pass chat_template_kwargs",
    "tool_parser": "the tool parser is the server's (CHARSERVE_TOOL_PARSER)",
}
# Values of a refused field that ask for nothing, so a client that sends them is served.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "store": (False,),
    "use_beam_search": (False,),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "modalities": (["text"],),
    "functions": ([],),
    "best_of": (1,),
    "service_tier": ("auto", "default"),
}
# Keys of a message this server does not serve.
REFUSED_MESSAGE_FIELDS: dict[str, str] = {
    "function_call": "function calling is not served",
    "audio": "this model takes text only",
    "refusal": "refusals are not produced by this model",
    "reasoning_content": "this model does not reason",
}


def _refuse_fields(data: Any, known: set[str], refused: dict[str, str]) -> Any:
    """A before-validator's body: 400 for a refused field (unless neutral) or an unknown one,
    naming it (``field`` in the error's context: the route's error names its full path).
    A null, or a refused field's neutral value, asks for nothing: it is served, and left
    out of what the model holds."""
    if not isinstance(data, dict):
        return data
    kept: dict[Any, Any] = {}
    for key, value in data.items():
        if key in known:
            kept[key] = value
            continue
        if value is None:
            continue
        if key in refused:
            if value in _NEUTRAL.get(key, ()):
                continue
            raise PydanticCustomError(
                "field_refused", f"{key} is not supported: {refused[key]}", {"field": key}
            )
        raise PydanticCustomError(
            "field_unknown",
            f"{key} is not a field of this API (the field list is in docs/api.md)",
            {"field": str(key)},
        )
    return kept


class TextPart(BaseModel):
    """A text content part."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of the conversation. ``name`` (who speaks) goes into the template, as
    vLLM passes it; a template that does not use it gets it as a ``name: `` prefix of the
    content, so it is never dropped."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, min_length=1, max_length=128)
    # An assistant's earlier calls, and a tool message's answer to one of them.
    tool_calls: list[MessageToolCall] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=128)

    @model_validator(mode="before")
    @classmethod
    def _fields(cls, data: Any) -> Any:
        return _refuse_fields(data, set(cls.model_fields), REFUSED_MESSAGE_FIELDS)

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError(
                "invalid_value", "only an assistant message has tool_calls", {"field": "tool_calls"}
            )
        if self.tool_call_id is not None and self.role != "tool":
            raise PydanticCustomError(
                "invalid_value", "only a tool message has tool_call_id", {"field": "tool_call_id"}
            )
        return self

    def text(self) -> str:
        """The message's text, with content parts joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    """``stream_options``: a final usage chunk, and (``continuous_usage_stats``) the usage
    so far on every chunk."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: free text, any JSON object, or JSON valid against a schema
    (the engine's structured outputs constrain every token)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or not self.json_schema.schema_
        ):
            raise PydanticCustomError(
                "invalid_value",
                "response_format.json_schema.schema is required with type json_schema",
                {"param": "response_format.json_schema"},
            )
        return self


# Bounds of a structured-output constraint: the engine compiles it once per request (a
# grammar's compile time grows with its size), on the worker.
MAX_CONSTRAINT_CHARS = 16_384
MAX_CHOICES = 256


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one constraint on the reply's text."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, max_length=MAX_CONSTRAINT_CHARS)
    choice: list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]] | None = Field(
        default=None, min_length=1, max_length=MAX_CHOICES
    )
    grammar: str | None = Field(default=None, max_length=MAX_CONSTRAINT_CHARS)
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def _given(self) -> dict[str, Any]:
        """The constraints set, under vLLM's ``StructuredOutputsParams`` names."""
        named = {
            "json": self.json_,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object or None,
        }
        return {k: v for k, v in named.items() if v is not None}

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = list(self._given())
        if len(given) != 1:
            raise PydanticCustomError(
                "invalid_value",
                "structured_outputs takes exactly one of json, regex, choice, grammar, "
                f"json_object; got {given or 'none'}",
                {"param": "structured_outputs"},
            )
        return self

    def wire(self) -> dict[str, Any]:
        """The constraint as the job carries it (vLLM's ``StructuredOutputsParams`` names)."""
        out = self._given()
        if self.disable_any_whitespace:
            out["disable_any_whitespace"] = True
        return out


def template_contradiction(
    add_generation_prompt: bool, continue_final_message: bool, last_role: str
) -> tuple[str, str] | None:
    """(param, why) when the template options contradict each other or the messages."""
    if continue_final_message and add_generation_prompt:
        return (
            "continue_final_message",
            "continue_final_message needs add_generation_prompt: false",
        )
    if continue_final_message and last_role != "assistant":
        return ("continue_final_message", "the last message must be the assistant's")
    return None


class SamplingRequest(BaseModel):
    """What a chat and a text completion share: the model, streaming, and every sampling
    field (see the module docstring for the refusal rules)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
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
    user: str | None = Field(default=None, max_length=256)  # logged with the request
    # The prompt (a text completion's) or the last assistant message (a chat's) in front
    # of the reply, as vLLM's echo.
    echo: bool | None = None
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
    # The roleplay samplers (docs/api.md#roleplay-samplers): vLLM logits processors on the
    # workers (workers/engines/samplers.py).
    dry_multiplier: float | None = Field(
        default=None,
        ge=0.0,
        allow_inf_nan=False,
        description="DRY's strength; DRY is on when above 0.",
    )
    dry_base: float | None = Field(
        default=None, gt=1.0, allow_inf_nan=False, description="DRY's growth base (1.75)."
    )
    dry_allowed_length: int | None = Field(
        default=None,
        ge=1,
        le=MAX_DRY_ALLOWED_LENGTH,
        description="Longest repeat DRY leaves unpenalized (2).",
    )
    dry_penalty_last_n: int | None = Field(
        default=None,
        ge=-1,
        description="Tokens of context DRY scans; 0 or -1: all of it (0).",
    )
    # A list; or, as text-generation-webui takes it, one string (made a list before the
    # list is checked).
    dry_sequence_breakers: (
        list[Annotated[str, Field(min_length=1, max_length=MAX_BREAKER_CHARS)]] | None
    ) = Field(
        default=None,
        max_length=MAX_SEQUENCE_BREAKERS,
        description='Strings that stop DRY\'s matching (["\\n", ":", "\\"", "*"]); a list, '
        "or text-generation-webui's one string of comma-separated JSON strings.",
    )
    xtc_threshold: float | None = Field(
        default=None,
        ge=0.0,
        le=MAX_XTC_THRESHOLD,
        description="XTC: tokens at least this likely are top choices (0.1).",
    )
    xtc_probability: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="XTC: the chance, per token, that it removes top choices; on above 0.",
    )
    # A list, or one string (made a list before the list is checked).
    banned_strings: (
        list[Annotated[str, Field(min_length=1, max_length=MAX_BANNED_CHARS)]] | None
    ) = Field(
        default=None,
        max_length=MAX_BANNED_STRINGS,
        description="Strings whose token sequences are never emitted (exact at token "
        "level); a list, or one string.",
    )
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* names (at most one constraint in all).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(default=None, max_length=MAX_CONSTRAINT_CHARS)
    guided_choice: list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]] | None = Field(
        default=None, min_length=1, max_length=MAX_CHOICES
    )
    guided_grammar: str | None = Field(default=None, max_length=MAX_CONSTRAINT_CHARS)

    @model_validator(mode="before")
    @classmethod
    def _fields(cls, data: Any) -> Any:
        """400 naming a refused or unknown field, before anything else is checked."""
        return _refuse_fields(data, set(cls.model_fields), REFUSED_FIELDS)

    @field_validator("dry_sequence_breakers", mode="before")
    @classmethod
    def _breakers_as_list(cls, value: Any) -> Any:
        """text-generation-webui's form (one string) as a list, checked as a list is."""
        return _webui_breakers(value) if isinstance(value, str) else value

    @field_validator("banned_strings", mode="before")
    @classmethod
    def _banned_as_list(cls, value: Any) -> Any:
        """One string as a list of one, checked as a list is."""
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _carriable(self) -> SamplingRequest:
        """400, not a 500 later, for what the job cannot carry: an integer beyond 64 bits
        (msgpack), text with a lone surrogate (UTF-8, the tokenizer), a logit_bias key
        that looks like a token id but is not one; and for options that contradict."""
        found = _uncarriable(self)
        for key in self.logit_bias or {}:
            digits = key.removeprefix("-")
            if found is None and digits.isdigit():  # the others are refused by the route
                if not digits.isascii() or not _INT_MIN <= int(key) <= _INT_MAX:
                    found = ("logit_bias", f"{key!r} is not a token id")
        if found is None and self.stream_options is not None and not self.stream:
            found = ("stream_options", "stream_options is only allowed when stream is true")
        if found is None and len(self._constraints()) > 1:
            found = ("response_format", f"one constraint at most, got {self._constraints()}")
        found = found or self._contradiction()
        if found is not None:
            param, why = found
            raise PydanticCustomError("invalid_value", why, {"param": param})
        return self

    def _contradiction(self) -> tuple[str, str] | None:
        """A subclass's own contradicting options: (param, why)."""
        return None

    def _constraints(self) -> list[str]:
        given = [
            n
            for n in ("structured_outputs", "guided_json", "guided_regex", "guided_choice")
            if getattr(self, n) is not None
        ]
        if self.guided_grammar is not None:
            given.append("guided_grammar")
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        return given

    def structured(self) -> dict[str, Any] | None:
        """The reply's constraint in vLLM's ``StructuredOutputsParams`` names, if any."""
        if self.structured_outputs is not None:
            return self.structured_outputs.wire()
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            return {"json_object": True}
        if rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
            return {"json": rf.json_schema.schema_}
        for name, key in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(self, name)
            if value is not None:
                return {key: value}
        return None

    def sampling(self) -> dict[str, Any]:
        """The sampling fields the job carries: the typed ones that were set, and nothing
        else (a job holds only what the engine uses)."""
        out: dict[str, Any] = {
            f: getattr(self, f)
            for f in SAMPLING_FIELDS
            if f not in ("stop", "logit_bias", "structured_outputs", "logprobs")
            and getattr(self, f, None) is not None
        }
        if self.stop is not None:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.logit_bias:
            out["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        structured = self.structured()
        if structured is not None:
            out["structured_outputs"] = structured
        top = self.top_logprobs_asked()
        if top is not None:
            out["logprobs"] = top
        return out

    def top_logprobs_asked(self) -> int | None:
        """How many alternatives each token's logprobs list (0: the token's own only), or
        None when the request asked for no logprobs."""
        return None

    @property
    def include_usage(self) -> bool:
        """True when the client asked for a final usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """True when the client asked for the usage so far on every chunk."""
        options = self.stream_options
        return bool(self.stream and options and options.continuous_usage_stats)


SessionAction = Literal["reply", "swipe", "continue", "impersonate", "warm"]


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions`` body."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        populate_by_name=True,
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

    messages: list[ChatMessage] = Field(
        default_factory=list,
        description="At least one, except for a session action other than reply, which "
        "takes none (the session holds the conversation).",
    )
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # The template: vLLM's chat fields.
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=16)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Tool calling (gateway/chat/tools.py).
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # charserve's persona chats (docs/api.md): a session turn, or a character's persona
    # around the client's own messages, and the user's name in it.
    session_id: str | None = Field(default=None, min_length=1, max_length=128)
    character_id: str | None = Field(default=None, min_length=1, max_length=128)
    user_name: str | None = Field(default=None, min_length=1, max_length=128)
    speaker: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="In a group session: the character (id) who speaks next; default by "
        "the group's rule (a member named in the message, else the next in turn).",
    )
    session_action: SessionAction = Field(
        default="reply",
        description="With session_id: reply (one new user message), swipe (another reply "
        "in place of the last one), continue (extend the last reply) or impersonate (write "
        "the user's next line; nothing is recorded) or warm (prefill the conversation into "
        "the engine's cache; one token, discarded). docs/api.md#sessions.",
    )

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def structured(self) -> dict[str, Any] | None:
        schema = constraint(self.tools, self.tool_choice, self.parallel_tool_calls)
        return {"json": schema} if schema is not None else super().structured()

    def _constraints(self) -> list[str]:
        given = super()._constraints()
        if constraint(self.tools, self.tool_choice, self.parallel_tool_calls) is not None:
            given.append("tool_choice")
        return given

    def _contradiction(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return ("top_logprobs", "top_logprobs needs logprobs: true")
        found = choice_contradiction(self.tools, self.tool_choice)
        if found is not None:
            return found
        if effective_choice(self.tools, self.tool_choice) not in (None, "none"):
            if self.logprobs:
                return ("logprobs", "logprobs are not served with tool calls")
            if self.echo:
                return ("echo", "echo is not served with tool calls")
            if self.session_id is not None or self.character_id is not None:
                return ("tools", "tools are not served in persona chats (session, character)")
        if self.speaker is not None and self.session_id is None:
            return ("speaker", "speaker needs a group session's session_id")
        if self.session_action != "reply":
            if self.session_id is None:
                return ("session_action", f"{self.session_action} needs a session_id")
            if self.messages:
                return ("messages", f"a {self.session_action} takes no messages")
            return None
        if not self.messages:
            return ("messages", "at least one message is required")
        return template_contradiction(
            self.add_generation_prompt, self.continue_final_message, self.messages[-1].role
        )


# OpenAI's default completion length for text completions (vLLM's too).
TEXT_DEFAULT_MAX_TOKENS = 16
MAX_PROMPT_TOKEN_IDS = 1 << 20


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions`` body: a prompt as text or token ids, continued as is (no
    chat template)."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        populate_by_name=True,
        json_schema_extra={
            "examples": [
                {
                    "model": "smollm2-135m-instruct",
                    "prompt": "Captain Mira Vance looked at the stars and said",
                    "max_tokens": 16,
                }
            ]
        },
    )

    prompt: str | list[Annotated[int, Field(ge=0)]] = Field(
        min_length=1, max_length=MAX_PROMPT_TOKEN_IDS
    )
    add_special_tokens: bool = True
    # The legacy API's logprobs: how many alternatives per token (OpenAI allows 5).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TEXT_LOGPROBS)

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def _contradiction(self) -> tuple[str, str] | None:
        if self.echo and self.logprobs is not None:
            return (
                "echo",
                "echo with logprobs needs the prompt's logprobs, which are not served; ask "
                "one or the other",
            )
        return None


def _webui_breakers(text: str) -> list[Any]:
    """``dry_sequence_breakers`` as text-generation-webui (and TabbyAPI) take it, one
    string: JSON strings separated by commas (``"\\n", ":", "\\"", "*"``), brackets
    optional. The list it holds is then checked as a list sent as one is."""
    text = text.strip()
    parsed: Any = None
    if len(text) <= MAX_BREAKERS_TEXT:
        try:
            parsed = json.loads(text if text.startswith("[") else f"[{text}]")
        except ValueError:
            pass
    if not isinstance(parsed, list):
        raise PydanticCustomError(
            "invalid_value",
            f"as one string (at most {MAX_BREAKERS_TEXT} characters), dry_sequence_breakers "
            'holds JSON strings separated by commas, as text-generation-webui takes it ("\\n", '
            '":"); or send a list of strings',
        )
    return parsed


_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what msgpack carries
_SURROGATE = re.compile("[\ud800-\udfff]")


def _uncarriable(value: Any) -> tuple[str, str] | None:
    """The first place in ``value`` that a job cannot carry (its dotted path), and why."""
    found = _first_uncarriable(value)
    return None if found is None else (".".join(reversed(found[0])), found[1])


def _first_uncarriable(value: Any) -> tuple[list[str], str] | None:
    """The first place in ``value`` that a job cannot carry (its path, innermost first),
    and why. Paths are built only for what is found: every request passes through here."""
    if isinstance(value, str):
        # An ASCII text (most of them) holds no surrogate, and str.isascii() is O(1).
        if not value.isascii() and _SURROGATE.search(value):
            return [], "text must be valid Unicode (this holds a lone surrogate)"
        return None
    if isinstance(value, BaseModel):
        # Its set fields (not dict(value), which a field named "keys" would break); a
        # field's name is the model's own, and most of a request's fields are None.
        fields = ((key, item) for key, item in value.__dict__.items() if item is not None)
        return _first_uncarriable_item(fields, check_keys=False)
    if isinstance(value, dict):
        return _first_uncarriable_item(value.items(), check_keys=True)
    if isinstance(value, list | tuple):
        return _first_uncarriable_item(enumerate(value), check_keys=False)
    if isinstance(value, int) and not isinstance(value, bool):
        if not _INT_MIN <= value <= _INT_MAX:
            return [], "integers must fit in 64 bits"
    return None


def _first_uncarriable_item(
    items: Iterable[tuple[Any, Any]], check_keys: bool
) -> tuple[list[str], str] | None:
    """:func:`_first_uncarriable` over (key or index, value) pairs (the keys too, if
    ``check_keys``), the key prepended to the path found."""
    for key, item in items:
        found = (check_keys and _first_uncarriable(key)) or _first_uncarriable(item)
        if found:
            found[0].append(str(key))
            return found
    return None
