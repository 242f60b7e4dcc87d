"""Turn chat messages into prompt token ids with the model's own tokenizer and template.

The gateway tokenises, not the worker, so that a prompt longer than the context window
(or a ``max_tokens`` that cannot fit) is refused with a 400 before anything is queued,
and so the worker hands vLLM token ids directly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from gateway.chat.pieces import PieceEncoder
from gateway.chat.schemas import (
    TEXT_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from gateway.chat.tools import template_tools, tools_chars
from gateway.http.errors import BadRequest

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Prompt:
    """A rendered prompt and the completion length it may have."""

    token_ids: list[int]
    max_tokens: int


# apply_chat_template's own parameters: chat_template_kwargs may not set them.
_TEMPLATE_PARAMS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "bos_token",
        "eos_token",
        "raise_exception",
    }
)


@dataclass(frozen=True, slots=True)
class TemplateOptions:
    """How the chat template renders a request (vLLM's chat fields)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)
    # The request's tools, for a template that renders them (OpenAI's shape).
    tools: list[dict[str, Any]] | None = None

    @classmethod
    def of(cls, request: ChatCompletionRequest) -> TemplateOptions:
        """A chat request's options (see :meth:`checked`)."""
        options = cls.checked(
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs,
        )
        tools = template_tools(request.tools)
        return replace(options, tools=tools) if tools else options

    @classmethod
    def checked(
        cls,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any] | None,
    ) -> TemplateOptions:
        """The options; 400 for a template variable that is not a plain value or that
        would overwrite the template's own inputs."""
        kwargs = template_kwargs or {}
        for key, value in kwargs.items():
            if key in _TEMPLATE_PARAMS or not isinstance(value, str | bool | int | float):
                raise BadRequest(
                    f"chat_template_kwargs.{key}: a template variable is a string, number or "
                    "boolean, and not one of the template's own inputs",
                    param=f"chat_template_kwargs.{key}",
                )
        return cls(add_generation_prompt, continue_final_message, dict(kwargs))


# Texts up to this many characters are rendered and tokenized on the event loop (about a
# millisecond); longer ones in a thread, as the loop belongs to every request.
ON_LOOP_CHARS = 16_384


class PromptBuilder:
    """Applies the model's chat template and checks lengths against the context window."""

    def __init__(self, model_path: str, max_model_len: int, default_max_tokens: int) -> None:
        from transformers import AutoTokenizer

        self._tokenizer: Any = AutoTokenizer.from_pretrained(model_path)
        if self._tokenizer.chat_template is None:
            raise ValueError(f"the tokenizer of {model_path} has no chat template")
        # A fast tokenizer's Rust backend (its public ``backend_tokenizer``) gives the same
        # ids without transformers' per-call BatchEncoding (about half the cost of encoding
        # a short prompt). A slow tokenizer has none: then transformers encodes.
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        self._backend: Any = backend if hasattr(backend, "encode_batch") else None
        # Where cutting at special tokens gives the tokenizer's own ids, a turn encodes
        # only its new pieces (see gateway.chat.pieces).
        self._pieces = PieceEncoder.of(self._backend)
        self.max_model_len = max_model_len
        self._default_max_tokens = default_max_tokens
        # No token covers more characters than the longest one in the vocabulary, so a text
        # of more than max_model_len times that many characters cannot fit: refused before
        # any tokenizing (which, for megabytes, would hold a thread for a long while).
        longest = max((len(t) for t in self._tokenizer.get_vocab()), default=1)
        template = self._tokenizer.chat_template
        self._template_uses_name = isinstance(template, str) and "['name']" in template
        self.max_prompt_chars = max_model_len * max(longest, 1)

    def requested_max_tokens(self, request: ChatCompletionRequest) -> int:
        """The completion length the request asks for, or the default."""
        asked = request.max_completion_tokens or request.max_tokens
        return asked if asked is not None else self._default_max_tokens

    def encode(
        self, messages: list[dict[str, Any]], options: TemplateOptions | None = None
    ) -> list[int]:
        """Prompt token ids of ``messages`` (template applied); 400 if it rejects them."""
        options = options or TemplateOptions()
        messages = [self._template_message(m) for m in messages]
        try:
            text = self._tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                **({"tools": options.tools} if options.tools else {}),
                **options.kwargs,
            )
        except Exception as exc:  # the template rejected this conversation
            raise BadRequest(f"cannot render the messages: {exc}", param="messages") from exc
        # The template already placed the special tokens, as vLLM's chat path does.
        if self._pieces is not None:
            return self._pieces.encode(text)
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    @property
    def vocab_size(self) -> int:
        """How many token ids the tokenizer knows (added tokens included)."""
        return len(self._tokenizer)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of plain text (a completion-style prompt)."""
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``."""
        return str(self._tokenizer.decode(token_ids))

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each token's own string."""
        return list(self._tokenizer.convert_ids_to_tokens(token_ids))

    def _template_message(self, message: dict[str, Any]) -> dict[str, Any]:
        """A message as the template takes it: ``developer`` as ``system``, a speaker's
        ``name`` either passed (a template that uses it) or prefixed to the content, and
        tool calls and tool call ids as they came."""
        out = {"role": _template_role(message["role"]), "content": message["content"]}
        for key in ("tool_calls", "tool_call_id"):
            if key in message:
                out[key] = message[key]
        name = message.get("name")
        if name:
            if self._template_uses_name:
                out["name"] = name
            else:
                out["content"] = f"{name}: {message['content']}"
        return out

    def count(self, messages: list[dict[str, str]]) -> int:
        """How many prompt tokens ``messages`` make."""
        return len(self.encode(messages))

    def check_chars(self, chars: int, param: str) -> None:
        """400 for a text of more characters than ``max_model_len`` tokens can hold,
        before any tokenizing (which, for megabytes, would hold a thread a long while)."""
        if chars > self.max_prompt_chars:
            raise BadRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, the {param} are {chars} characters, more than that many tokens "
                f"can hold. Please reduce the length of the {param}.",
                param=param,
                code="context_length_exceeded",
            )

    def build(
        self,
        request: ChatCompletionRequest,
        messages: list[dict[str, str]] | None = None,
        options: TemplateOptions | None = None,
    ) -> Prompt:
        """Render ``messages`` (default: the request's) with ``options`` (default: the
        request's) and decide ``max_tokens``; 400 if they cannot fit."""
        if messages is None:
            messages = template_messages(request.messages)
        self.check_chars(prompt_chars(messages) + tools_chars(request.tools), "messages")
        token_ids = self.encode(messages, options or TemplateOptions.of(request))
        prompt_len = len(token_ids)
        room = self.max_model_len - prompt_len
        if room < 1:
            raise BadRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your messages resulted in {prompt_len} tokens. "
                "Please reduce the length of the messages.",
                param="messages",
                code="context_length_exceeded",
            )
        asked = request.max_completion_tokens or request.max_tokens
        if asked is not None and asked > room:
            raise BadRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_len + asked} tokens ({prompt_len} in the "
                f"messages, {asked} in the completion). Please reduce the length of the "
                "messages or completion.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return Prompt(
            token_ids, asked if asked is not None else min(self._default_max_tokens, room)
        )

    def build_text(self, request: CompletionRequest) -> Prompt:
        """A text completion's prompt: its text tokenized as is (no template), or its token
        ids checked against the vocabulary; 400 if it cannot fit."""
        if isinstance(request.prompt, str):
            self.check_chars(len(request.prompt), "prompt")
            token_ids = self.encode_text(request.prompt, request.add_special_tokens)
        else:
            token_ids = list(request.prompt)
            vocab = self.vocab_size
            bad = next((t for t in token_ids if t >= vocab), None)
            if bad is not None:
                raise BadRequest(f"{bad} is not a token id of this model", param="prompt")
        prompt_len = len(token_ids)
        asked = request.max_tokens if request.max_tokens is not None else TEXT_DEFAULT_MAX_TOKENS
        if prompt_len + asked > self.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_len + asked} tokens ({prompt_len} in the "
                f"prompt, {asked} in the completion). Please reduce the length of the "
                "prompt or completion.",
                param="max_tokens" if prompt_len < self.max_model_len else "prompt",
                code="context_length_exceeded",
            )
        return Prompt(token_ids, asked)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """A request's messages as the template takes them (text, the speaker's name, tool
    calls and the id of the call a tool message answers)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [call.template() for call in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def prompt_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the messages' contents and tool calls."""
    return sum(
        len(m["content"]) + (len(json.dumps(m["tool_calls"])) if "tool_calls" in m else 0)
        for m in messages
    )


def _template_role(role: str) -> str:
    # Chat templates know system/user/assistant; OpenAI's newer "developer" is a system turn.
    return "system" if role == "developer" else role
