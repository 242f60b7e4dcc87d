"""Turn chat messages into prompt token ids with the model's own tokenizer and template.

The gateway tokenises, not the worker, so that a prompt longer than the context window
(or a ``max_tokens`` that cannot fit) is refused with a 400 before anything is queued,
and so the worker hands vLLM token ids directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from gateway.chat.schemas import ChatCompletionRequest
from gateway.http.errors import BadRequest

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Prompt:
    """A rendered prompt and the completion length it may have."""

    token_ids: list[int]
    max_tokens: int


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
        self.max_model_len = max_model_len
        self._default_max_tokens = default_max_tokens
        # No token covers more characters than the longest one in the vocabulary, so a text
        # of more than max_model_len times that many characters cannot fit: refused before
        # any tokenizing (which, for megabytes, would hold a thread for a long while).
        longest = max((len(t) for t in self._tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = max_model_len * max(longest, 1)

    def requested_max_tokens(self, request: ChatCompletionRequest) -> int:
        """The completion length the request asks for, or the default."""
        asked = request.max_completion_tokens or request.max_tokens
        return asked if asked is not None else self._default_max_tokens

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt token ids of ``messages`` (template applied); 400 if it rejects them."""
        messages = [{"role": _template_role(m["role"]), "content": m["content"]} for m in messages]
        try:
            text = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # the template rejected this conversation
            raise BadRequest(f"cannot render the messages: {exc}", param="messages") from exc
        # The template already placed the special tokens, as vLLM's chat path does.
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def count(self, messages: list[dict[str, str]]) -> int:
        """How many prompt tokens ``messages`` make."""
        return len(self.encode(messages))

    def build(
        self, request: ChatCompletionRequest, messages: list[dict[str, str]] | None = None
    ) -> Prompt:
        """Render ``messages`` (default: the request's) and decide ``max_tokens``; 400 if
        they cannot fit."""
        if messages is None:
            messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        chars = prompt_chars(messages)
        if chars > self.max_prompt_chars:
            raise BadRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your messages hold {chars} characters, more than that many tokens "
                "can. Please reduce the length of the messages.",
                param="messages",
                code="context_length_exceeded",
            )
        token_ids = self.encode(messages)
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


def prompt_chars(messages: list[dict[str, str]]) -> int:
    """Characters of the messages' contents."""
    return sum(len(m["content"]) for m in messages)


def _template_role(role: str) -> str:
    # Chat templates know system/user/assistant; OpenAI's newer "developer" is a system turn.
    return "system" if role == "developer" else role
