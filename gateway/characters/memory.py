"""Session memory: the oldest turns of a long conversation, summarised on the cluster.

When a session turn's prompt passes ``memory_share`` of the context window, a summary job
is queued in the batch class, so it never delays a chat: its prompt is the configured
instruction, the previous summary (a later summary extends it) and the transcript of the
turns it takes in (every message but the latest ``memory_keep_messages``, cut in front of a
user message, and as many as fit the window). Its reply becomes the session's memory,
placed after the persona (see :mod:`gateway.characters.persona_chat`); the covered turns
are no longer sent. Until it lands, and if it fails, the prompt is cut to the window as
before: the summary only ever adds what the cut would lose.

One job per session at a time, across gateways (a claim in the session's hash, held for
the batch budget); a deletion or trim that moves the covered messages meanwhile makes its
result stale, and it is dropped.
"""

from __future__ import annotations

import asyncio
import uuid

import structlog
from redis.exceptions import RedisError

from cluster.characters.persona import expand_macros
from cluster.runtime.clock import RedisClock
from cluster.runtime.settings import Settings
from gateway.characters.persona_chat import PersonaTurn
from gateway.characters.store import CharacterStore, Session
from gateway.chat.admission import classify
from gateway.chat.prompts import PromptBuilder
from gateway.chat.schemas import ChatCompletionRequest, ChatMessage
from gateway.chat.service import ChatContext, ChatService, whole_reply
from gateway.http.errors import APIError

log = structlog.get_logger(__name__)

# Room for the template and the instruction besides the transcript.
_OVERHEAD_TOKENS = 64


class SessionMemory:
    """Queues a session's summary job when its prompts grow long."""

    def __init__(
        self,
        store: CharacterStore,
        chat: ChatService,
        prompts: PromptBuilder,
        settings: Settings,
        clock: RedisClock,
    ) -> None:
        self._store = store
        self._chat = chat
        self._prompts = prompts
        self._settings = settings
        self._clock = clock
        self._tasks: set[asyncio.Task[None]] = set()

    def consider(self, turn: PersonaTurn) -> None:
        """Start a summary of ``turn``'s session if its prompt passed the share (or was cut)."""
        share = self._settings.memory_share
        if not share or turn.session_id is None:
            return
        if turn.prompt_tokens < share * self._settings.max_model_len and not turn.dropped:
            return
        task = asyncio.create_task(self._summarise(turn.tenant, turn.session_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Cancel the jobs in flight (their claims lapse after the hold)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _summarise(self, tenant: str, session_id: str) -> None:
        hold_ms = self._settings.budget_batch_ms
        try:
            if not await self._store.claim_summary(tenant, session_id, hold_ms):
                return
        except RedisError as exc:
            log.warning("session summary not started", session_id=session_id, error=str(exc))
            return
        summary, covered, now_covers = "", 0, 0
        try:
            summary, covered, now_covers = await self._ask(tenant, session_id)
        except (APIError, RedisError, LookupError, ValueError) as exc:
            # Refused (the tenant's class or limits), failed or gone: the cut stays the
            # fallback, and the next long turn tries again.
            log.warning("session summary failed", session_id=session_id, error=str(exc))
        try:
            stored = await self._store.record_summary(
                tenant, session_id, covered, now_covers, summary
            )
        except RedisError as exc:  # the claim lapses after its hold
            log.warning("session summary not stored", session_id=session_id, error=str(exc))
            return
        if summary:
            log.info("session summarised", session_id=session_id, covers=now_covers, stored=stored)

    async def _ask(self, tenant: str, session_id: str) -> tuple[str, int, int]:
        """Run the summary job: (summary, messages covered before, covered after); an
        empty summary when there is nothing old enough."""
        session = await self._store.session(tenant, session_id)
        character = await self._store.character(tenant, session.character_id)
        covered = session.summary_upto
        name = character.card.display_name
        picked = await asyncio.to_thread(self._transcript, session, name)
        if picked is None:
            return "", covered, covered
        request, taken = picked
        settings = self._settings
        admission = classify(settings, self._clock.now_ms(), "batch", str(settings.budget_batch_ms))
        ctx = ChatContext(f"mem-{uuid.uuid4().hex}", tenant, admission)
        response = await self._chat.complete(request, ctx)
        reply = whole_reply(response)["choices"][0]["message"]["content"]
        return str(reply).strip(), covered, covered + taken

    def _transcript(
        self, session: Session, char_name: str
    ) -> tuple[ChatCompletionRequest, int] | None:
        """The summary request and how many messages it takes in, or None when there is
        nothing old enough to summarise."""
        settings = self._settings
        pending = session.messages[session.summary_upto :]
        end = len(pending) - settings.memory_keep_messages
        # Cut in front of a user message, so an exchange stays on one side.
        while end > 0 and pending[end]["role"] != "user":
            end -= 1
        if end <= 0:
            return None
        names = {"user": session.user_name, "assistant": char_name}
        instruction = expand_macros(settings.memory_prompt, char=char_name, user=session.user_name)
        head = f"Previous summary: {session.summary}\n\n" if session.summary else ""
        room = settings.max_model_len - settings.memory_max_tokens - _OVERHEAD_TOKENS
        room -= self._prompts.count([{"role": "system", "content": instruction + head}])
        lines: list[str] = []
        taken = 0
        for message in pending[:end]:
            name = message.get("name") or names.get(message["role"], message["role"])
            line = f"{name}: {message['content']}"
            cost = self._prompts.count([{"role": "user", "content": line}])
            if cost > room:
                break
            room -= cost
            lines.append(line)
            taken += 1
        # A cut inside an exchange is fine here: the rest is taken in by the next summary.
        if not taken:
            return None
        request = ChatCompletionRequest(
            model=settings.served_model_name,
            messages=[
                ChatMessage(role="system", content=instruction),
                ChatMessage(role="user", content=head + "Transcript:\n" + "\n".join(lines)),
            ],
            max_tokens=settings.memory_max_tokens,
            temperature=0.3,
        )
        return request, taken
