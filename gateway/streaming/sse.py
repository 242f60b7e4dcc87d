"""OpenAI chat-completion and text-completion chunk and response bodies, and SSE framing.

Shapes follow OpenAI exactly: the first delta carries the role, ``finish_reason`` appears
only on the last choice chunk (with an empty delta), ``stream_options.include_usage``
adds a final chunk with ``choices: []`` and every earlier chunk carries ``usage: null``,
and the stream ends with ``data: [DONE]``. OpenAI sends no ``id:`` lines, and clients that
parse SSE by hand (vLLM's own benchmark client among them) split on blank lines and strip a
leading ``data: ``, so an event carries ``id: <seq>`` (the worker chunk it came from, for
resuming with ``Last-Event-ID``) only when the formatter is asked for event ids: for a
resumable request, one that asks for them, and the resume endpoint. A request that waits
long for its first token gets comment lines meanwhile (:data:`KEEPALIVE`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from cluster.wire.protocol import Chunk
from gateway.http.errors import from_worker
from gateway.streaming.tool_calls import ToolMode, ToolStream, shape_whole

DONE = b"data: [DONE]\n\n"
# Sent while a streamed request waits for its first token, so that no idle timeout (a load
# balancer's, a proxy's) cuts the connection: an SSE comment, which SSE parsers skip.
KEEPALIVE = b": keep-alive\n\n"
# Written in front of the first event after keep-alives: an empty comment. vLLM's benchmark
# client strips each read's trailing newlines before buffering it, so a keep-alive that
# arrived alone stays in its buffer without its blank line and would swallow the next event
# ("...keep-alivedata: {...}"); the blank line of this comment, in the same read as that
# event, ends the keep-alive there.
KEEPALIVE_END = b":\n\n"

# What a reply is framed as: a chat completion, or a text completion (/v1/completions).
ReplyKind = Literal["chat", "text"]
COMPLETION_ID_PREFIX: dict[str, str] = {"chat": "chatcmpl-", "text": "cmpl-"}
_CHUNK_OBJECT = {"chat": "chat.completion.chunk", "text": "text_completion"}


# One encoder for the process: json.dumps with non-default options builds a new encoder
# on every call, which costs more than encoding a token's text.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _dumps(obj: Any) -> str:
    return _ENCODER.encode(obj)


def usage(chunk: Chunk) -> dict[str, Any]:
    """The OpenAI ``usage`` object from a final chunk's counts."""
    return summed_usage((chunk,))


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(entries: list[Any]) -> dict[str, Any]:
    """A chat choice's ``logprobs`` from a chunk's entries (see :class:`Chunk`)."""
    return {
        "content": [
            {**_token(text, lp), "top_logprobs": [_token(a, alp) for a, alp in alts]}
            for text, lp, alts in entries
        ],
        "refusal": None,
    }


def text_logprobs(entries: list[Any], offset: int) -> dict[str, Any]:
    """A text completion choice's ``logprobs`` (the legacy shape), its text starting at
    character ``offset`` of the completion."""
    offsets = []
    for text, _, _ in entries:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": [text for text, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [{a: alp for a, alp in alts} for _, _, alts in entries],
        "text_offset": offsets,
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
    A text completion's chunks carry ``text`` in the choice (no role, no delta).
    """

    completion_id: str
    model: str
    created: int
    include_usage: bool
    role_sent: bool = False
    event_ids: bool = False
    # stream_options.continuous_usage_stats: the usage so far on every chunk.
    continuous_usage: bool = False
    kind: ReplyKind = "chat"
    # The choice this formatter's events belong to (``n`` > 1: one formatter per choice).
    index: int = 0
    # Whether the usage chunk (include_usage) follows this choice's final chunk; False for
    # one choice of several, after whose last the request's usage comes once.
    usage_last: bool = True
    # Text in front of the reply's first piece (echo), sent once.
    echo: str = ""
    # How the reply becomes tool calls (None: it is content), for a chat with tools.
    tools: ToolMode | None = None
    _tool_stream: ToolStream | None = None
    # Characters of a text completion so far: where its next logprobs' text_offset starts.
    _offset: int = 0
    _content_head: bytes = b""
    _content_tail: bytes = b""

    def __post_init__(self) -> None:
        if self.kind == "text":
            # A text completion has no role to send; its first event carries any echo.
            self.role_sent = not self.echo
        elif self.tools is not None:
            self._tool_stream = ToolStream(self.tools, self.completion_id, self.index)
        marker = "\x00text\x00"
        head, tail = _dumps(self._body([self._choice(marker, None)], None)).split(_dumps(marker))
        self._content_head = f"data: {head}".encode()
        self._content_tail = f"{tail}\n\n".encode()

    def _choice(
        self,
        text: str | None,
        finish: str | None,
        role: bool = False,
        logprobs: list[Any] | None = None,
    ) -> dict[str, Any]:
        if self.kind == "text":
            shaped = text_logprobs(logprobs, self._offset) if logprobs else None
            return {
                "index": self.index,
                "text": text or "",
                "logprobs": shaped,
                "finish_reason": finish,
            }
        delta: dict[str, Any] = {} if text is None else {"content": text}
        if role:
            delta = {"role": "assistant", "content": text}
        shaped = chat_logprobs(logprobs) if logprobs else None
        return {"index": self.index, "delta": delta, "logprobs": shaped, "finish_reason": finish}

    def _body(self, choices: list[dict[str, Any]], usage_obj: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.completion_id,
            "object": _CHUNK_OBJECT[self.kind],
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

    def usage_event(self, seq: int, usage_obj: dict[str, Any]) -> bytes:
        """The last chunk ``stream_options.include_usage`` asks for: no choices, the usage."""
        return self._event(seq, [], usage_obj)

    def is_content(self, chunk: Chunk) -> bool:
        """True when ``chunk``'s events are just :meth:`content_event`."""
        return (
            self.role_sent
            and bool(chunk.text)
            and not chunk.is_final
            and not self.continuous_usage
            and not chunk.logprobs
            and self._tool_stream is None
        )

    def events(self, chunk: Chunk) -> bytes:
        """The SSE bytes for one worker chunk (content, then finish and usage if final)."""
        if self.is_content(chunk):
            return self.content_event(chunk.seq, chunk.text)
        if self._tool_stream is not None:
            return self._tool_events(self._tool_stream, chunk)
        out = b""
        so_far = usage(chunk) if self.continuous_usage else None
        text, self.echo = self.echo + chunk.text, ""
        # A step whose token has no text yet (the first bytes of a character, text held
        # back by a stop string) still gets its event, with empty content, as vLLM's server
        # sends it: clients that count events as tokens (vLLM's benchmark client) then see
        # each step, not two steps' tokens arriving at once. A final chunk's own finish
        # event is that step's event.
        stepped = bool(chunk.token_ids) and not chunk.is_final
        if text or stepped or chunk.logprobs or not self.role_sent:
            choice = self._choice(text, None, role=not self.role_sent, logprobs=chunk.logprobs)
            # Offsets matter only with logprobs, whose chunks never take the fast path.
            self._offset += len(text)
            self.role_sent = True
            out += self._event(chunk.seq, [choice], so_far)
        if chunk.is_final:
            out += self._event(chunk.seq, [self._choice(None, finish_reason(chunk))], so_far)
            if self.include_usage and self.usage_last:
                out += self.usage_event(chunk.seq, usage(chunk))
        return out

    def _tool_events(self, stream: ToolStream, chunk: Chunk) -> bytes:
        """The events of one chunk of a reply that may be tool calls: its deltas (the role
        on the first), then the finish (and usage) if final."""
        so_far = usage(chunk) if self.continuous_usage else None
        deltas = stream.feed(chunk.text)
        finish = None
        if chunk.is_final:
            more, finish = stream.end(finish_reason(chunk))
            deltas += more
        if not self.role_sent:
            self.role_sent = True
            head = {"role": "assistant", "content": None}
            deltas = [{**head, **deltas[0]}, *deltas[1:]] if deltas else [head]
        out = b"".join(
            self._event(chunk.seq, [self._delta_choice(delta, None)], so_far) for delta in deltas
        )
        if finish is not None:
            out += self._event(chunk.seq, [self._delta_choice({}, finish)], so_far)
            if self.include_usage and self.usage_last:
                out += self.usage_event(chunk.seq, usage(chunk))
        return out

    def _delta_choice(self, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": finish}

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


def summed_usage(finals: Sequence[Chunk]) -> dict[str, Any]:
    """The usage of a request's choices together: its prompt once (every choice had the
    same), the completions summed, as OpenAI counts ``n`` > 1."""
    first = finals[0]
    completion = sum(final.completion_tokens for final in finals)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }


def _text_choice(index: int, text: str, final: Chunk) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": text_logprobs(final.logprobs, 0) if final.logprobs else None,
        "finish_reason": finish_reason(final),
    }


def _chat_choice(index: int, text: str, final: Chunk) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text, "refusal": None},
        "logprobs": chat_logprobs(final.logprobs) if final.logprobs else None,
        "finish_reason": finish_reason(final),
    }


def _tool_choice(
    tools: ToolMode, completion_id: str, index: int, text: str, final: Chunk
) -> dict[str, Any]:
    content, calls, finish = shape_whole(tools, text, finish_reason(final), completion_id, index)
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls is not None:
        message["tool_calls"] = calls
    return {"index": index, "message": message, "logprobs": None, "finish_reason": finish}


def whole_body(
    kind: ReplyKind,
    completion_id: str,
    model: str,
    created: int,
    replies: Sequence[tuple[str, Chunk]],
    tools: ToolMode | None = None,
    echo: str = "",
) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` or ``text_completion`` response: one choice
    per reply (its text and its final chunk), in order; with ``tools``, a chat reply's
    text as tool calls where it makes them; with ``echo``, that text in front of each."""
    choice = _text_choice if kind == "text" else _chat_choice
    if tools is not None and kind == "chat":

        def choice(index: int, text: str, final: Chunk) -> dict[str, Any]:
            return _tool_choice(tools, completion_id, index, text, final)

    return {
        "id": completion_id,
        "object": "text_completion" if kind == "text" else "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [choice(i, echo + text, final) for i, (text, final) in enumerate(replies)],
        "usage": summed_usage([final for _, final in replies]),
    }
