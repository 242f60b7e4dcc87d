"""Recovering jobs whose worker is gone: requeue with attempt+1 (continuing the reply
where the client stopped receiving it), or dead-letter after too many attempts.

A job's reply log says which tokens already reached the client. A retry resubmits the
prompt plus those tokens as the start of the assistant's reply, with the chunk sequence
continuing after the last logged chunk, so the client sees one seamless stream and never
sees text twice. A job whose log already holds its final chunk finished; it is only acked.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Literal

import redis.asyncio as aioredis
import structlog

from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import Chunk, Job
from cluster.wire.queue import JobQueue, Poison
from cluster.wire.replylog import read_reply_log
from cluster.wire.vocabulary import ErrorCode
from workers.loop.publisher import Publisher, RequestStream

log = structlog.get_logger(__name__)

Outcome = Literal["finished", "requeued", "dead_lettered", "lost_lease", "cancelled"]


def resumed(job: Job, delivered: list[Chunk], attempt: int) -> Job:
    """``job`` set to continue after the chunks already delivered."""
    if not delivered:  # nothing reached the client: start over (keeping any old resume)
        return dataclasses.replace(job, attempt=attempt)
    # The log holds every chunk of every attempt, so it alone says what was delivered.
    return dataclasses.replace(
        job,
        attempt=attempt,
        resume_token_ids=[t for c in delivered for t in c.token_ids],
        resume_seq=delivered[-1].seq,
    )


class Recovery:
    """Requeues or dead-letters jobs this worker holds the lease of."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        queue: JobQueue,
        publisher: Publisher,
        worker_id: str,
        max_attempts: int,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._queue = queue
        self._publisher = publisher
        self._worker_id = worker_id
        self._max_attempts = max_attempts

    async def recover(self, job: Job, *, count_attempt: bool = True) -> Outcome:
        """Decide and carry out what happens to an orphaned (or handed-back) job."""
        delivered = await read_reply_log(self._redis, self._keys, job.id)
        if delivered and delivered[-1].is_final:
            await self._queue.ack(job.id, self._worker_id)
            return "finished"
        attempt = job.attempt + 1 if count_attempt else job.attempt
        if attempt >= self._max_attempts:
            reason = f"the request failed on {attempt} workers in a row and was dead-lettered"
            return await self._dead_letter(job.id, protocol.encode(job), reason, job, delivered)
        retry = resumed(job, delivered, attempt)
        requeued = await self._queue.requeue(retry, self._worker_id)
        if requeued == "lost":
            return "lost_lease"
        if requeued == "cancelled":
            # Cancelled while no worker held it: it ends here, with a clear last chunk.
            await self._finish(retry, delivered, ErrorCode.CANCELLED, "the request was cancelled")
            return "cancelled"
        log.warning(
            "job requeued",
            request_id=job.id,
            attempt=attempt,
            resume_tokens=len(retry.resume_token_ids),
        )
        return "requeued"

    async def poison(self, poison: Poison) -> Outcome:
        """Dead-letter a job whose body cannot even be decoded."""
        log.error("undecodable job", request_id=poison.id, error=poison.error)
        return await self._dead_letter(poison.id, poison.body, poison.error, None, [])

    async def _dead_letter(
        self, job_id: str, body: bytes, reason: str, job: Job | None, delivered: list[Chunk]
    ) -> Outcome:
        if not await self._queue.dead_letter(job_id, body, self._worker_id):
            return "lost_lease"
        log.error("job dead-lettered", request_id=job_id, reason=reason)
        if job is not None:
            await self._finish(
                resumed(job, delivered, job.attempt), delivered, ErrorCode.DEAD_LETTER, reason
            )
        return "dead_lettered"

    async def _finish(
        self, job: Job, delivered: list[Chunk], code: ErrorCode, message: str
    ) -> None:
        """End the client's stream with a clear error, right after what it received."""
        last = delivered[-1] if delivered else None
        stream = RequestStream(
            job=job,
            worker_id=self._worker_id,
            queue_ms=0.0,
            completion_tokens=last.completion_tokens if last else 0,
            prompt_tokens=last.prompt_tokens if last else len(job.prompt_token_ids),
        )
        stream.fail(code, message)
        self._publisher.mark(stream)
        await asyncio.wait_for(stream.done.wait(), timeout=30.0)
