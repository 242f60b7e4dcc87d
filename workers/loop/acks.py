"""Acks of finished jobs, several in one script call.

A closed loop of chats finishes its replies together: at 32 streams with fixed reply
lengths, 31 jobs end in the same engine step, and each ack was a script call of its own
(17 keys packed, a round trip, a reply parsed) in the replica's process, on the core the
next group's intake needs. :class:`AckBatcher` coalesces them the way the publisher
coalesces chunks: the first ack starts one call, every ack that arrives while a call is in
flight goes in the next one, so a lone ack waits for nothing and a burst costs one or two
calls. Each caller still awaits its own job's result (or the call's error).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from cluster.wire.turns import Call

# Bounds one script call (Redis runs nothing else meanwhile): about ten commands an ack.
MAX_ACKS_PER_CALL = 256


class AckQueue(Protocol):
    """What the batcher needs of :class:`~cluster.wire.queue.JobQueue`."""

    async def ack_many(self, worker_id: str, finished: list[tuple[str, int]]) -> list[bool]:
        """Ack each (job id, tokens generated); one bool per pair."""
        ...


class AckBatcher:
    """Acks this worker's finished jobs, coalescing those that finish together."""

    def __init__(self, queue: AckQueue, worker_id: str) -> None:
        self._queue = queue
        self._worker_id = worker_id
        self._pending: list[Call[tuple[str, int]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.calls = 0  # script calls made, for tests and the curious

    async def ack(self, job_id: str, completion_tokens: int = 0) -> bool:
        """Ack one job; False if its lease was no longer ours. Raises what the call raised
        (a ``RedisError``): the job's lease then expires and it is recovered."""
        call = Call((job_id, completion_tokens), asyncio.get_running_loop().create_future())
        self._pending.append(call)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="acks")
        result: bool = await call.future
        return result

    async def close(self) -> None:
        """Wait for the acks already asked for."""
        if self._flusher is not None:
            await asyncio.gather(self._flusher, return_exceptions=True)

    async def _flush(self) -> None:
        while self._pending:
            batch = self._pending[:MAX_ACKS_PER_CALL]
            del self._pending[:MAX_ACKS_PER_CALL]
            self.calls += 1
            try:
                results = await self._queue.ack_many(self._worker_id, [call.item for call in batch])
            except asyncio.CancelledError:
                for call in batch + self._pending:
                    call.future.cancel()
                raise
            except Exception as exc:  # every waiter gets the call's own error
                for call in batch:
                    call.answer(exc)
                continue
            for call, result in zip(batch, results, strict=True):
                call.answer(result)  # unless its waiter was cancelled meanwhile
