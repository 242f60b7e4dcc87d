"""OpenAI chat-completion chunk and response bodies, and SSE framing.

Shapes follow OpenAI exactly: the first delta carries the role, ``finish_reason`` appears
only on the last choice chunk (with an empty delta), ``stream_options.include_usage``
adds a final chunk with ``choices: []`` and every earlier chunk carries ``usage: null``,
and the stream ends with ``data: [DONE]``. OpenAI sends no ``id:`` lines, and clients that
parse SSE by hand (vLLM's own benchmark client among them) split on blank lines and strip a
leading ``data: ``, so an event carries ``id: <seq>`` (the worker chunk it came from, for
resuming with ``Last-Event-ID``) only when the formatter is asked for event ids: for a
resumable request, one that asks for them, and the resume endpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cluster.wire.protocol import Chunk
from gateway.http.errors import from_worker

DONE = b"data: [DONE]\n\n"


# One encoder for the process: json.dumps with non-default options builds a new encoder
# on every call, which costs more than encoding a token's text.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _dumps(obj: Any) -> str:
    return _ENCODER.encode(obj)


def usage(chunk: Chunk) -> dict[str, Any]:
    """The OpenAI ``usage`` object from a final chunk's counts."""
    return {
        "prompt_tokens": chunk.prompt_tokens,
        "completion_tokens": chunk.completion_tokens,
        "total_tokens": chunk.prompt_tokens + chunk.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": chunk.cached_tokens},
    }


def finish_reason(chunk: Chunk) -> str:
    """OpenAI finish reason of a final chunk (vLLM's ``abort`` is not an OpenAI value)."""
    reason = chunk.finish_reason or "stop"
    return reason if reason in ("stop", "length", "content_filter", "tool_calls") else "stop"


@dataclass(slots=True)
class ChunkFormatter:
    """Formats one request's stream; remembers whether the role was sent.

    A content event (every chunk but the first and the last) is the same JSON each time
    but for the text, so it is built from bytes made once per stream: the hot path is one
    ``json.dumps`` of the text and a join, byte for byte what the general path writes.
    """

    completion_id: str
    model: str
    created: int
    include_usage: bool
    role_sent: bool = False
    event_ids: bool = False
    # stream_options.continuous_usage_stats: the usage so far on every chunk.
    continuous_usage: bool = False
    _content_head: bytes = b""
    _content_tail: bytes = b""

    def __post_init__(self) -> None:
        marker = "\x00text\x00"
        choices = [
            {"index": 0, "delta": {"content": marker}, "logprobs": None, "finish_reason": None}
        ]
        head, tail = _dumps(self._body(choices, None)).split(_dumps(marker))
        self._content_head = f"data: {head}".encode()
        self._content_tail = f"{tail}\n\n".encode()

    def _body(self, choices: list[dict[str, Any]], usage_obj: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.include_usage or usage_obj is not None:
            body["usage"] = usage_obj
        return body

    def content_event(self, seq: int, text: str) -> bytes:
        """The event of a content chunk after the first (what :meth:`events` writes)."""
        return b"".join(
            (
                b"id: %d\n" % seq if self.event_ids else b"",
                self._content_head,
                _dumps(text).encode(),
                self._content_tail,
            )
        )

    def _event(self, seq: int, choices: list[dict[str, Any]], usage_obj: Any = None) -> bytes:
        head = f"id: {seq}\n" if self.event_ids else ""
        return f"{head}data: {_dumps(self._body(choices, usage_obj))}\n\n".encode()

    def is_content(self, chunk: Chunk) -> bool:
        """True when ``chunk``'s events are just :meth:`content_event`."""
        return (
            self.role_sent and bool(chunk.text) and not chunk.is_final and not self.continuous_usage
        )

    def events(self, chunk: Chunk) -> bytes:
        """The SSE bytes for one worker chunk (content, then finish and usage if final)."""
        if self.is_content(chunk):
            return self.content_event(chunk.seq, chunk.text)
        out = b""
        so_far = usage(chunk) if self.continuous_usage else None
        if chunk.text or not self.role_sent:
            delta: dict[str, Any] = {"content": chunk.text}
            if not self.role_sent:
                delta = {"role": "assistant", "content": chunk.text}
                self.role_sent = True
            out += self._event(
                chunk.seq,
                [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
                so_far,
            )
        if chunk.is_final:
            out += self._event(
                chunk.seq,
                [
                    {
                        "index": 0,
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": finish_reason(chunk),
                    }
                ],
                so_far,
            )
            if self.include_usage:
                out += self._event(chunk.seq, [], usage(chunk))
        return out

    def render(self, chunk: Chunk) -> bytes:
        """Everything the client gets for one worker chunk: its events, and ``[DONE]``
        after the final one; an error chunk becomes an error event and ``[DONE]``."""
        if chunk.error_code is not None:
            return error_event(from_worker(chunk.error_code, chunk.error_message).body()) + DONE
        out = self.events(chunk)
        return out + DONE if chunk.is_final else out


def error_event(body: dict[str, Any]) -> bytes:
    """An error inside an already-started stream (the ``openai`` client raises on it)."""
    return f"data: {_dumps(body)}\n\n".encode()


def completion_body(
    completion_id: str, model: str, created: int, text: str, final: Chunk
) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` response."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": finish_reason(final),
            }
        ],
        "usage": usage(final),
    }
