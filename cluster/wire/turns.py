"""Calls made in one turn of the event loop, sent on together at the turn's end.

Work that arrives together is handled in one turn: a clump of requests reaching a gateway,
the jobs of one claim reaching a replica. When each call goes on to another process by
itself, the first ones are already there, and acted on, while the rest are still being
prepared. :class:`TurnBatch` holds the calls of one turn and hands them to one
``send`` at its end, so they arrive together: the queue's enqueues as one Redis pipeline
(:mod:`cluster.wire.queue`), a claim's jobs as one burst to vLLM's engine core
(:mod:`workers.engines.vllm_engine`).

Nothing waits for a batch to fill: ``send`` runs after the callbacks already due in the
turn, and takes only the calls made by then. A call alone goes on its own, one task hop
later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class Call(Generic[T]):
    """One call waiting in a batch: what it asked to send, and its caller's answer."""

    item: T
    future: asyncio.Future[Any] = field(repr=False)

    @property
    def left(self) -> bool:
        """True once its caller stopped waiting (it was cancelled), or it was answered."""
        return self.future.done()

    def answer(self, reply: Any) -> None:
        """Give the caller its reply, unless it left; an exception is raised to it."""
        if self.left:
            return
        if isinstance(reply, BaseException):
            self.future.set_exception(reply)
        else:
            self.future.set_result(reply)


class TurnBatch(Generic[T]):
    """Gathers the calls of one event-loop turn for one ``send``.

    ``send`` gets every call of the turn, in order, and answers each (:meth:`Call.answer`).
    A call it leaves unanswered, or every call when it is cancelled (the process stopping),
    is cancelled for its caller: no caller waits for ever.
    """

    def __init__(self, send: Callable[[list[Call[T]]], Awaitable[None]]) -> None:
        self._send = send
        self._pending: list[Call[T]] = []
        self._sending: set[asyncio.Task[None]] = set()

    async def call(self, item: T) -> Any:
        """Send ``item`` with the turn's other calls; the reply ``send`` gave it."""
        loop = asyncio.get_running_loop()
        call = Call(item, loop.create_future())
        self._pending.append(call)
        if len(self._pending) == 1:
            # Runs after the callbacks already due this turn: the rest of the clump.
            task = loop.create_task(self._flush())
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        return await call.future

    async def _flush(self) -> None:
        calls, self._pending = self._pending, []
        try:
            await self._send(calls)
        finally:
            for call in calls:
                call.future.cancel()  # those answered, or whose caller left, stay as they are
