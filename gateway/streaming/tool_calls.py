"""A reply's text as OpenAI's ``tool_calls``, whole and streamed.

How a reply becomes tool calls depends on how the request asked for them
(:class:`ToolMode`, decided by :mod:`gateway.chat.tools`):

- ``named`` (``tool_choice: {"type": "function", ...}``): the engine's structured outputs
  constrain the whole reply to the function's parameters, so the reply *is* the call's
  ``arguments``; streamed, the arguments arrive as they are generated (vLLM does the same).
- ``required``: the reply is constrained to a JSON array of ``{"name", "parameters"}``
  (vLLM's schema for ``required``); it is parsed when complete, so a stream sends the calls
  in one delta at its end.
- ``auto`` with the ``hermes`` parser: the model decides. Text is content until a
  ``<tool_call>`` tag (Hermes, Qwen 2.5 and others write ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``); from there the rest is parsed when complete. A stream
  holds back only a tail that could be the start of the tag.

A reply that does not parse (cut off by ``max_tokens``, or a model that wrote no valid
call) is returned as content, with its own finish reason: nothing is dropped. Call ids are
derived from the completion id, so a replay (resume, attach) shows the same ids.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

ToolKind = Literal["named", "required", "auto"]
# The tool-call formats the gateway parses for tool_choice "auto" (CHARSERVE_TOOL_PARSER).
TOOL_PARSERS = ("hermes",)

_HERMES_OPEN = "<tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolMode:
    """How a request's reply becomes tool calls (kept with the request's metadata)."""

    kind: ToolKind
    name: str = ""  # the function, for ``named``
    parser: str = ""  # the format, for ``auto``


def call_id(completion_id: str, choice: int, position: int) -> str:
    """A tool call's id: stable for one completion, choice and position."""
    digest = hashlib.sha256(f"{completion_id}:{choice}:{position}".encode()).hexdigest()
    return f"call_{digest[:24]}"


def _call(cid: str, name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": cid, "type": "function"}
    out["function"] = {"name": name, "arguments": arguments}
    if index is not None:
        out = {"index": index, **out}
    return out


def _parsed_calls(mode: ToolMode, text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call in ``text`` (the part after any content), or
    None when it does not parse as calls."""
    try:
        if mode.kind == "required":
            items = json.loads(text)
            calls = [(item["name"], json.dumps(item["parameters"])) for item in items]
        else:
            calls = []
            for block in _HERMES_BLOCK.findall(text):
                item = json.loads(block)
                arguments = item.get("arguments", item.get("parameters", {}))
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments)
                calls.append((item["name"], arguments))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    if not calls or not all(isinstance(name, str) and name for name, _ in calls):
        return None
    return calls


def shape_whole(
    mode: ToolMode, text: str, finish: str, completion_id: str, choice: int
) -> tuple[str | None, list[dict[str, Any]] | None, str]:
    """A whole reply as (content, tool_calls, finish reason)."""
    if mode.kind == "named":
        return None, [_call(call_id(completion_id, choice, 0), mode.name, text)], finish
    content, tail = "", text
    if mode.kind == "auto":
        at = text.find(_HERMES_OPEN)
        if at < 0:
            return text, None, finish
        content, tail = text[:at].strip(), text[at:]
    calls = _parsed_calls(mode, tail)
    if calls is None:
        return text, None, finish
    shaped = [
        _call(call_id(completion_id, choice, i), name, arguments)
        for i, (name, arguments) in enumerate(calls)
    ]
    return content or None, shaped, "tool_calls"


class ToolStream:
    """One streamed choice's text as deltas: content, or tool calls (see the module)."""

    def __init__(self, mode: ToolMode, completion_id: str, choice: int) -> None:
        self._mode = mode
        self._completion_id = completion_id
        self._choice = choice
        self._held = ""  # text not sent yet: a possible tag start, or the calls so far
        self._in_calls = mode.kind != "auto"
        self._started = False  # a named call's head is out

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas ``text`` (the next piece of the reply) makes now."""
        if not text:
            return []
        if self._mode.kind == "named":
            if self._started:
                return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
            self._started = True
            cid = call_id(self._completion_id, self._choice, 0)
            return [{"tool_calls": [_call(cid, self._mode.name, text, 0)]}]
        self._held += text
        if self._in_calls:
            return []
        at = self._held.find(_HERMES_OPEN)
        if at >= 0:
            content, self._held = self._held[:at], self._held[at:]
            self._in_calls = True
        else:
            keep = _tag_prefix_len(self._held)
            content = self._held[: len(self._held) - keep]
            self._held = self._held[len(content) :]
        return [{"content": content}] if content else []

    def end(self, finish: str) -> tuple[list[dict[str, Any]], str]:
        """The last deltas, and the choice's finish reason, once the reply is complete."""
        if self._mode.kind == "named":
            if self._started:
                return [], finish
            cid = call_id(self._completion_id, self._choice, 0)
            return [{"tool_calls": [_call(cid, self._mode.name, "", 0)]}], finish
        held, self._held = self._held, ""
        if not held:
            return [], finish
        calls = _parsed_calls(self._mode, held) if self._in_calls else None
        if calls is None:
            return [{"content": held}], finish
        shaped = [
            _call(call_id(self._completion_id, self._choice, i), name, arguments, i)
            for i, (name, arguments) in enumerate(calls)
        ]
        return [{"tool_calls": shaped}], "tool_calls"


def _tag_prefix_len(text: str) -> int:
    """How many of ``text``'s last characters could begin the tool-call tag."""
    for n in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):
        if _HERMES_OPEN.startswith(text[-n:]):
            return n
    return 0
