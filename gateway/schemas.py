"""OpenAI Chat Completions request and response shapes.

Requests accept unknown fields (frontends send extra samplers): known vLLM samplers are
typed here so a wrong type is a 400 before anything is queued; other extras pass through
to the worker, which hands vLLM the ones it understands.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


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

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra samplers.
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None

    def sampling(self) -> dict[str, Any]:
        """Sampling fields for the worker: typed ones that were set, plus unknown extras."""
        fields = (
            "temperature",
            "top_p",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "top_k",
            "min_p",
            "repetition_penalty",
            "min_tokens",
            "ignore_eos",
            "stop_token_ids",
            "skip_special_tokens",
            "include_stop_str_in_output",
        )
        out: dict[str, Any] = {f: getattr(self, f) for f in fields if getattr(self, f) is not None}
        if self.stop is not None:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.logit_bias:
            out["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        out.update(self.model_extra or {})
        return out

    @property
    def include_usage(self) -> bool:
        """True when the client asked for a final usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)
