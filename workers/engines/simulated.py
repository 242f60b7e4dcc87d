"""A simulated engine for the control plane, in the spirit of llm-d's inference simulator.

It models continuous batching without a model: one step advances every running request by
one token, and a step takes ``step_base_ms + step_ms_per_seq * batch`` plus
``prefill_ms_per_token`` for each prompt token of requests that join in that step. Tokens
are a deterministic function of the request's prompt and position, so a reply continued on
another replica after a failover is the same text an uninterrupted one would have been.

It is selected only by explicit configuration (``engine_kind: simulated`` in the Serve
config args); it exists to measure and test the queue, relay and failover paths at scales
and speeds the CPU engine cannot reach, never to serve users.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from cluster.wire.protocol import Job
from workers.engines.base import EngineOutput, OutputSink

_VOCAB = 997


class SimulatedConfig(BaseModel):
    """Timing model of the simulated engine."""

    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int = Field(default=32, ge=1)
    step_base_ms: float = Field(default=20.0, ge=0)
    step_ms_per_seq: float = Field(default=1.0, ge=0)
    prefill_ms_per_token: float = Field(default=0.05, ge=0)


def simulated_token(prompt_token_ids: list[int], position: int) -> int:
    """The token the simulator emits at ``position`` of the reply to this prompt."""
    return _token(sum(prompt_token_ids), position)


def _token(prompt_sum: int, position: int) -> int:
    return (prompt_sum * 31 + position * 7) % _VOCAB


def simulated_text(token_id: int) -> str:
    """The text of a simulated token."""
    return f" w{token_id}"


@dataclass(slots=True)
class _Running:
    job: Job
    position: int
    remaining: int
    # Receives this request's outputs from the step loop (see workers.engines.base.PushEngine).
    sink: OutputSink
    # Resolved when the reply ended (or with the exception its sink raised).
    ended: asyncio.Future[None]
    # The part of simulated_token that depends on the prompt alone.
    prompt_sum: int
    prefilled: bool = False


class SimulatedEngine:
    """Implements :class:`workers.engines.base.PushEngine` with a timing model."""

    def __init__(self, config: SimulatedConfig) -> None:
        self._config = config
        self._running: dict[str, _Running] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._texts = [simulated_text(token) for token in range(_VOCAB)]

    @property
    def max_slots(self) -> int:
        return self._config.max_num_seqs

    @property
    def honours_seed(self) -> bool:
        return True  # its text is a function of the job alone

    @property
    def adapters(self) -> frozenset[str]:
        return frozenset()  # no model, so no adapters

    async def generate(self, job: Job, priority: int) -> AsyncIterator[EngineOutput]:
        outputs: asyncio.Queue[EngineOutput] = asyncio.Queue()
        state = self._admit(job, outputs.put_nowait)
        try:
            while True:
                out = await outputs.get()
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            self._leave(state)

    async def generate_into(self, job: Job, priority: int, sink: OutputSink) -> None:
        state = self._admit(job, sink)
        try:
            await state.ended
        finally:
            self._leave(state)

    def _admit(self, job: Job, sink: OutputSink) -> _Running:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._step_loop(), name="simulated-engine")
        state = _Running(
            job=job,
            position=len(job.resume_token_ids),
            remaining=job.max_tokens - len(job.resume_token_ids),
            sink=sink,
            ended=asyncio.get_running_loop().create_future(),
            prompt_sum=sum(job.prompt_token_ids),
        )
        self._running[job.id] = state
        self._wake.set()
        return state

    def _leave(self, state: _Running) -> None:
        # Only this request's own entry: a retry of the same job may have replaced it.
        if self._running.get(state.job.id) is state:
            del self._running[state.job.id]

    async def _step_loop(self) -> None:
        cfg = self._config
        loop = asyncio.get_running_loop()
        next_step_s = loop.time()
        while True:
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
                next_step_s = loop.time()
            batch = list(self._running.values())
            prefill = sum(len(r.job.prompt_token_ids) for r in batch if not r.prefilled)
            step_ms = cfg.step_base_ms + cfg.step_ms_per_seq * len(batch)
            # Steps keep their own cadence: the time this process spends handing outputs
            # on (the consumer, the publisher) does not lengthen the modelled step, as
            # vLLM's engine core steps in its own process. A late step starts at once but
            # is never made up for.
            next_step_s += (step_ms + cfg.prefill_ms_per_token * prefill) / 1000.0
            now_s = loop.time()
            if next_step_s < now_s:
                next_step_s = now_s
            await asyncio.sleep(next_step_s - now_s)
            self._step(batch)

    def _step(self, batch: list[_Running]) -> None:
        """Advance every request of ``batch`` still running by one token."""
        running, texts = self._running, self._texts
        for r in batch:
            if r.remaining <= 0 or running.get(r.job.id) is not r:
                continue
            r.prefilled = True
            token = _token(r.prompt_sum, r.position)
            r.position += 1
            r.remaining -= 1
            out = EngineOutput(
                text=texts[token],
                token_ids=[token],
                finish_reason="length" if r.remaining <= 0 else None,
                prompt_tokens=len(r.job.prompt_token_ids),
            )
            try:
                r.sink(out)
            except Exception as exc:  # the sink's failure ends its request, not the engine
                r.remaining = 0
                if not r.ended.done():
                    r.ended.set_exception(exc)
                continue
            if out.finish_reason is not None and not r.ended.done():
                r.ended.set_result(None)

    async def abort(self, request_id: str) -> None:
        self._running.pop(request_id, None)

    async def check_health(self) -> None:
        if self._loop_task is not None and self._loop_task.done():
            raise RuntimeError("the simulated engine's step loop stopped")

    def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
