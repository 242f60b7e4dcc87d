"""Chats answered in character: a chat request with ``session_id`` (one user message; the
session holds the history) or ``character_id`` (the persona wrapped around the client's own
messages) becomes a persona prompt (:mod:`cluster.characters.persona` assembles it), a
preferred replica (session affinity), and, when the reply completes, the turns to record.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass

from cluster.characters.persona import PromptTooLong, assemble
from gateway.characters.store import CharacterStore, Session
from gateway.chat.schemas import ChatCompletionRequest
from gateway.http.errors import BadRequest


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


class PersonaChat:
    """Turns a request with ``session_id`` (or ``character_id``) into a persona prompt."""

    def __init__(
        self,
        store: CharacterStore,
        count_tokens: Callable[[list[dict[str, str]]], int],
        max_model_len: int,
        default_system_prompt: str = "",
        affinity: bool = True,
    ) -> None:
        self._store = store
        self._count = count_tokens
        self._max_model_len = max_model_len
        self._default_system = default_system_prompt
        self._affinity = affinity

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
        if isinstance(session_id, str):
            last = request.messages[-1] if request.messages else None
            if len(request.messages) != 1 or last is None or last.role != "user":
                raise BadRequest(
                    "a session turn is exactly one user message; the session holds the history",
                    param="messages",
                )
            session = await self._store.session(tenant, session_id)
            character = await self._store.character(tenant, session.character_id)
            history = [*session.messages, {"role": "user", "content": last.text()}]
            user_name = session.user_name
        else:
            character = await self._store.character(tenant, str(character_id))
            history = [{"role": m.role, "content": m.text()} for m in request.messages]
            user_name = request.user_name or request.user or "User"
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
                )
            )
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
            messages=assembled.messages,
            tenant=tenant,
            character_id=character.id,
            session_id=session.id if session else None,
            user_text=history[-1]["content"],
            prefer=prefer,
            dropped=assembled.dropped,
        )

    async def completed(self, turn: PersonaTurn, reply: str, worker_id: str) -> None:
        """Record a completed reply: both turns into the session, and where it ran."""
        if turn.session_id is not None:
            await self._store.append_turn(
                turn.tenant, turn.session_id, turn.user_text, reply, worker_id
            )
        if worker_id:
            await self._store.note_character_worker(turn.tenant, turn.character_id, worker_id)
