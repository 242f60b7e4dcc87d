"""The engine a worker drives: the :class:`Engine` protocol, the seam between the consumer
loop and the model.

Production always uses :class:`~workers.engines.vllm_engine.VllmEngine`; the simulator
(:mod:`workers.engines.simulated`) serves control-plane benchmarks, and unit tests may
inject a deterministic engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from cluster.wire.protocol import Job
from cluster.wire.vocabulary import BATCH_SCORE_OFFSET, PriorityClass

# vLLM priorities at or above this are batch work (the queue's offset for batch jobs);
# see workers/engines/scheduler.py.
BATCH_PRIORITY_BASE = BATCH_SCORE_OFFSET


def engine_priority(job: Job) -> int:
    """vLLM priority of a job (lower runs first): its deadline in ms, EDF order, shifted
    past every latency-bound request if it is batch work."""
    if job.priority_class == PriorityClass.BATCH:
        return job.deadline_ms + BATCH_PRIORITY_BASE
    return job.deadline_ms


@dataclass(slots=True)
class EngineOutput:
    """One step's output for one request: the new text and tokens since the last one.

    Built once per request per engine step, and never changed after: not frozen only
    because a frozen dataclass costs twice as much to build (0.6 µs a token)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int = 0
    # One ``[text, logprob, [[alternative, logprob], ...]]`` per token, when the job asked
    # (see :class:`cluster.wire.protocol.Chunk`).
    logprobs: list[Any] | None = None


class Engine(Protocol):
    """What a worker needs from a model engine."""

    @property
    def max_slots(self) -> int:
        """Requests the engine runs at once (its batch slots)."""
        ...

    @property
    def honours_seed(self) -> bool:
        """Whether a job's ``seed`` makes its sampling reproducible on this engine."""
        ...

    @property
    def adapters(self) -> frozenset[str]:
        """The LoRA adapters loaded (a job whose model is one of them runs with it)."""
        ...

    def generate(self, job: Job, priority: int) -> AsyncIterator[EngineOutput]:
        """Stream the reply to ``job``; cancelling the iteration aborts the request."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a running request and free its slot."""
        ...

    async def check_health(self) -> None:
        """Raise if the engine is dead."""
        ...

    def shutdown(self) -> None:
        """Stop the engine and its processes."""
        ...


# Receives one request's outputs, in order, as the engine produces them. It must not block
# and should not raise: an engine calls it from its own step loop.
OutputSink = Callable[[EngineOutput], None]


class PushEngine(Engine, Protocol):
    """An engine that can hand outputs to a sink from its own step loop.

    With thousands of streams, waking one task per request per token (what iterating
    :meth:`Engine.generate` costs) is most of a worker's CPU. An engine that steps every
    request in one place (the simulator) can instead call each request's sink directly,
    so a request's task wakes only when its reply ends. vLLM's engine does not: its
    outputs arrive per request through ``AsyncLLM.generate`` anyway.
    """

    async def generate_into(self, job: Job, priority: int, sink: OutputSink) -> None:
        """Run ``job``, calling ``sink`` with each output; return once the reply ended.
        Cancelling the call aborts the request; an exception ``sink`` raises ends it,
        and is raised here."""
        ...


async def run_generation(engine: Engine, job: Job, priority: int, sink: OutputSink) -> None:
    """Run ``job`` on ``engine`` and hand every output to ``sink``: through the engine's
    push path when it has one (:class:`PushEngine`), else by iterating ``generate``.
    Either way the caller sees the same outputs in the same order, and cancellation and
    errors reach it the same way."""
    push = getattr(engine, "generate_into", None)
    if push is not None:
        await push(job, priority, sink)
        return
    async for out in engine.generate(job, priority):
        sink(out)
