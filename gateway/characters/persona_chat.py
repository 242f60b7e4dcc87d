"""Chats answered in character: a chat request with ``session_id`` (one user message; the
session holds the history) or ``character_id`` (the persona wrapped around the client's own
messages) becomes a persona prompt (:mod:`cluster.characters.persona` assembles it), a
preferred replica (session affinity), and, when the reply completes, the turns to record.

A session request's ``session_action`` says what it does with the conversation:

- ``reply``: one new user message, answered; both are appended.
- ``swipe``: another reply in place of the last one. Its prompt is the last reply's own,
  token for token, so the prefix cache serves all of it; the new reply is shown and the
  former ones are kept as alternatives.
- ``continue``: the last reply extended where it stopped (the template continues the final
  assistant message instead of opening a new one); the text is appended to it.
- ``impersonate``: the user's next line, written as the user; nothing is recorded (the
  client sends it as a reply if the user keeps it).
- ``warm``: the conversation so far prefilled on the replica its next turn will prefer,
  so that turn finds it in the prefix cache (the user opened the chat, or is typing);
  nothing is generated beyond one discarded token, nothing recorded.

A character with a LoRA ``adapter`` (its own fine-tune) speaks through it: a turn whose
``model`` is the base model runs with the speaking character's adapter instead (the
request's ``model`` becomes the adapter's name, as vLLM serves adapters); a request that
names an adapter itself keeps it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import structlog

from cluster.characters.persona import Layout, PromptTooLong, assemble, expand_macros
from gateway.characters.store import Character, CharacterStore, Session, speaker
from gateway.chat.prompts import TemplateOptions
from gateway.chat.schemas import ChatCompletionRequest, SessionAction
from gateway.http.errors import BadRequest, Conflict, model_not_found

log = structlog.get_logger(__name__)

IMPERSONATE_PROMPT = (
    "[Write your next reply from the point of view of {{user}}, using the chat history so "
    "far as a guideline for the writing style of {{user}}. Don't write as {{char}} or "
    "system. Don't describe actions of {{char}}.]"
)
"""The instruction an impersonation ends with (SillyTavern's default wording)."""

MEMORY_LABEL = "Summary of the story so far:\n"
"""What the session's memory is introduced with, after the persona."""


class LongSessions(Protocol):
    """Told of every recorded session turn (see :mod:`gateway.characters.memory`)."""

    def consider(self, turn: PersonaTurn) -> None:
        """Summarise the session's oldest turns if ``turn``'s prompt was long."""


@dataclass(frozen=True, slots=True)
class PersonaTurn:
    """A chat request answered in character: its messages, where it should run, and
    what to record when the reply completes."""

    messages: list[dict[str, str]]
    tenant: str
    character_id: str
    session_id: str | None
    user_text: str
    prefer: str | None
    dropped: int
    action: SessionAction = "reply"
    expected_len: int = 0
    template: TemplateOptions | None = None
    prompt_tokens: int = 0
    speaker: dict[str, str] | None = None
    """In a group chat: who speaks (recorded with the reply)."""


# How an action's prompt ends: continue the last reply; warm ends after the conversation
# (its next turn's prompt goes on from there). The others open a new assistant turn.
_TEMPLATES = {
    "continue": TemplateOptions(add_generation_prompt=False, continue_final_message=True),
    "warm": TemplateOptions(add_generation_prompt=False),
}


class PersonaChat:
    """Turns a request with ``session_id`` (or ``character_id``) into a persona prompt."""

    def __init__(
        self,
        store: CharacterStore,
        count_tokens: Callable[[list[dict[str, str]]], int],
        max_model_len: int,
        default_system_prompt: str = "",
        affinity: bool = True,
        layout: Layout = "stable",
        served_model_name: str = "",
        adapters: Callable[[], frozenset[str]] = frozenset,
    ) -> None:
        self._store = store
        self._served_model_name = served_model_name
        # The LoRA adapters live workers serve now (the gateway's capacity snapshot).
        self._adapters = adapters
        self._count = count_tokens
        self._max_model_len = max_model_len
        self._default_system = default_system_prompt
        self._affinity = affinity
        self._layout: Layout = layout
        self.memory: LongSessions | None = None

    async def resolve(
        self,
        request: ChatCompletionRequest,
        tenant: str,
        max_tokens: int,
        free_by_worker: dict[str, int],
    ) -> PersonaTurn | None:
        """The persona turn for ``request``, or None for a plain OpenAI request."""
        session_id, character_id = request.session_id, request.character_id
        if session_id is None and character_id is None:
            return None
        session: Session | None = None
        action = request.session_action
        group: list[Character] = []
        if isinstance(session_id, str):
            session = await self._store.session(tenant, session_id)
            if session.group:
                group = list(
                    await asyncio.gather(
                        *(self._store.character(tenant, cid) for cid in session.group)
                    )
                )
                character = _next_speaker(request, session, group)
            elif request.speaker is not None:
                raise BadRequest("speaker is for group sessions", param="speaker")
            else:
                character = await self._store.character(tenant, session.character_id)
            user_name = session.user_name
            instruction = expand_macros(
                IMPERSONATE_PROMPT, char=character.card.display_name, user=user_name
            )
            history = self._history(request, session, instruction)
        else:
            character = await self._store.character(tenant, str(character_id))
            history = [{"role": m.role, "content": m.text()} for m in request.messages]
            user_name = request.user_name or request.user or "User"
        self._speak_through_adapter(request, character)
        memory = f"{MEMORY_LABEL}{session.summary}" if session and session.summary else ""
        try:
            # Off the event loop: lorebook scans and the token counts of the history cut
            # can take milliseconds (regex keys up to their time bound).
            assembled = await asyncio.to_thread(
                functools.partial(
                    assemble,
                    character.card,
                    history,
                    user_name=user_name,
                    default_system_prompt=self._default_system,
                    count_tokens=self._count,
                    max_prompt_tokens=self._max_model_len - max_tokens,
                    layout=self._layout,
                    memory=memory,
                    group=[c.card for c in group],
                )
            )
            messages = assembled.messages
            if action == "continue":
                # The reply being continued must end the prompt (after any post-history
                # instructions) for the template to continue it.
                reply = next(m for m in reversed(messages) if m["role"] == "assistant")
                messages = [m for m in messages if m is not reply] + [reply]
        except PromptTooLong as exc:
            raise BadRequest(
                f"This model's maximum context length is {self._max_model_len} tokens; the "
                f"character's persona and the latest message alone need {exc.prompt_tokens} "
                f"tokens with {max_tokens} for the reply.",
                param="messages",
                code="context_length_exceeded",
            ) from exc
        prefer = None
        if self._affinity:
            candidates = [session.last_worker] if session and session.last_worker else []
            if not candidates:
                candidates = [await self._store.character_worker(tenant, character.id)]
            # Only a live worker with room: an overloaded or vanished one is not waited for.
            prefer = next((w for w in candidates if free_by_worker.get(w, 0) > 0), None)
        return PersonaTurn(
            messages=messages,
            tenant=tenant,
            character_id=character.id,
            session_id=session.id if session else None,
            user_text=history[-1]["content"] if action == "reply" else "",
            prefer=prefer,
            dropped=assembled.dropped,
            action=action,
            expected_len=len(session.messages) if session else 0,
            template=self._template(request),
            prompt_tokens=assembled.prompt_tokens,
            speaker=speaker(character) if group else None,
        )

    def _speak_through_adapter(self, request: ChatCompletionRequest, character: Character) -> None:
        """Run a base-model turn with the character's adapter (see the module docstring);
        404 ``model_not_found`` when no live worker serves that adapter."""
        adapter = character.adapter
        if not adapter or request.model != self._served_model_name:
            return
        if adapter not in self._adapters():
            raise model_not_found(
                adapter, f" (the LoRA adapter of character {character.id!r}): no replica serves it"
            )
        request.model = adapter

    @staticmethod
    def _template(request: ChatCompletionRequest) -> TemplateOptions | None:
        """The template options of the request's action (None: the request's own)."""
        ends = _TEMPLATES.get(request.session_action)
        if ends is None:
            return None
        return replace(ends, kwargs=TemplateOptions.of(request).kwargs)

    @staticmethod
    def _history(
        request: ChatCompletionRequest, session: Session, impersonation: str
    ) -> list[dict[str, str]]:
        """The conversation the prompt is built from, for the request's action."""
        action, stored = request.session_action, session.history()
        if action == "reply":
            last = request.messages[-1]
            if len(request.messages) != 1 or last.role != "user":
                raise BadRequest(
                    "a session turn is exactly one user message; the session holds the history",
                    param="messages",
                )
            return [*stored, {"role": "user", "content": last.text()}]
        if action == "impersonate":
            return [*stored, {"role": "system", "content": impersonation}]
        if action == "warm":
            return stored
        if not stored or stored[-1]["role"] != "assistant":
            raise Conflict(
                f"a {action} needs the session to end with the character's reply",
                param="session_action",
                code="no_reply_to_" + action,
            )
        if action == "swipe":
            if len(stored) < 2 or stored[-2]["role"] != "user":
                raise Conflict(
                    "a swipe needs a reply to a user message (a greeting is chosen when the "
                    "session opens: greeting_index, random_greeting)",
                    param="session_action",
                    code="no_reply_to_swipe",
                )
            # The prompt the last reply answered, byte for byte.
            return stored[:-1]
        return stored

    async def completed(self, turn: PersonaTurn, reply: str, worker_id: str) -> None:
        """Record a completed reply (as its action says) and where it ran."""
        if turn.session_id is not None and turn.action == "reply":
            await self._store.append_turn(
                turn.tenant, turn.session_id, turn.user_text, reply, worker_id, turn.speaker
            )
        elif turn.session_id is not None and turn.action in ("swipe", "continue"):
            mode = "swipe" if turn.action == "swipe" else "extend"
            recorded = await self._store.replace_last(
                turn.tenant, turn.session_id, turn.expected_len, reply, worker_id, mode
            )
            if not recorded:
                log.warning(
                    "the conversation changed while the reply ran; not recorded",
                    session_id=turn.session_id,
                    action=turn.action,
                )
        if turn.session_id is not None and turn.action == "reply" and self.memory is not None:
            self.memory.consider(turn)
        if worker_id:
            await self._store.note_character_worker(turn.tenant, turn.character_id, worker_id)


def _next_speaker(
    request: ChatCompletionRequest, session: Session, group: list[Character]
) -> Character:
    """Who speaks next in a group chat: the request's ``speaker``; for a swipe or continue,
    the last reply's; else a member the user's message names (the earliest named), else
    the member after the last one who spoke."""
    by_id = {c.id: c for c in group}
    if request.speaker is not None:
        if request.speaker not in by_id:
            raise BadRequest(
                f"{request.speaker!r} is not a character of this group session", param="speaker"
            )
        return by_id[request.speaker]
    last = next(
        (
            m["character_id"]
            for m in reversed(session.messages)
            if m["role"] == "assistant" and m.get("character_id") in by_id
        ),
        None,
    )
    if request.session_action in ("swipe", "continue") and last is not None:
        return by_id[last]
    if request.session_action == "reply" and request.messages:
        text = request.messages[-1].text().lower()
        named = [
            (at, i)
            for i, c in enumerate(group)
            if (at := text.find(c.card.display_name.lower())) >= 0
        ]
        if named:
            return group[min(named)[1]]
    if last is None:
        return group[0]
    return group[(list(by_id).index(last) + 1) % len(group)]
