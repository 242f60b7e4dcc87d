"""Test doubles for the control plane (never used in production): a deterministic engine,
and :func:`make_chunk`.

It yields ``job.max_tokens`` tokens named ``" t0"``, ``" t1"``, ... (a retry continues
after its resume tokens) with an optional delay per token, records what it was asked to
run, and can be told to fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from cluster.wire.protocol import Chunk, Job
from tests.polling import Signal
from workers.engines.base import EngineOutput, OutputSink


class FakeEngine:
    """Implements :class:`workers.engines.base.Engine` without a model."""

    def __init__(
        self, max_slots: int = 4, delay_s: float = 0.0, fail_with: str | None = None
    ) -> None:
        self._max_slots = max_slots
        self.delay_s = delay_s
        self.fail_with = fail_with
        # Appended to every token's text (long replies for tests of slow readers).
        self.padding = ""
        self.seeds = True  # whether it claims to honour seeds (a CPU vLLM does not)
        self.loras: frozenset[str] = frozenset()  # the LoRA adapters it claims to serve
        self.running = 0
        self.max_running_seen = 0
        self.started: list[str] = []
        self.jobs: dict[str, Job] = {}
        self.aborted: list[str] = []
        self.priorities: dict[str, int] = {}
        self.release = asyncio.Event()
        self.release.set()
        self._signal = Signal()
        self.wait_until = self._signal.wait_until

    def _touch(self) -> None:
        self._signal.touch()

    @property
    def max_slots(self) -> int:
        return self._max_slots

    @property
    def honours_seed(self) -> bool:
        return self.seeds

    @property
    def adapters(self) -> frozenset[str]:
        return self.loras

    async def generate(self, job: Job, priority: int) -> AsyncIterator[EngineOutput]:
        self.started.append(job.id)
        self.jobs[job.id] = job
        self.priorities[job.id] = priority
        self.running += 1
        self.max_running_seen = max(self.max_running_seen, self.running)
        self._touch()
        try:
            if self.fail_with:
                raise RuntimeError(self.fail_with)
            # A retry continues after the tokens already delivered.
            for i in range(len(job.resume_token_ids), job.max_tokens):
                await self.release.wait()
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                last = i == job.max_tokens - 1
                top = job.sampling.get("logprobs")
                text = f" t{i}{self.padding}"
                yield EngineOutput(
                    text=text,
                    token_ids=[i],
                    finish_reason="length" if last else None,
                    prompt_tokens=len(job.prompt_token_ids),
                    # A fake distribution: the token at -0.5, alternatives below it.
                    logprobs=None
                    if top is None
                    else [
                        [
                            text,
                            -0.5,
                            [[text, -0.5]] + [[f" a{k}", -1.0 - k] for k in range(top - 1)],
                        ]
                    ],
                )
        finally:
            self.running -= 1
            self._touch()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._touch()

    async def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


class FakePushEngine(FakeEngine):
    """:class:`FakeEngine` through the push path (:class:`workers.engines.base.PushEngine`): a
    task of the engine's own calls the sink, as the simulator's step loop does, so the
    consumer's tests run against both ways of receiving outputs."""

    async def generate_into(self, job: Job, priority: int, sink: OutputSink) -> None:
        async def feed() -> None:
            async for out in self.generate(job, priority):
                sink(out)

        task = asyncio.create_task(feed(), name=f"fake-engine-{job.id}")
        try:
            await task
        finally:
            task.cancel()


def make_chunk(seq: int, text: str = "x", **fields: object) -> Chunk:
    """Chunk ``seq`` of request ``r`` (one token unless ``text`` is empty); ``fields`` sets
    any other field, e.g. ``finish_reason`` for a final chunk."""
    values: dict[str, object] = {
        "request_id": "r",
        "seq": seq,
        "text": text,
        "completion_tokens": seq,
        "prompt_tokens": 3,
        "token_ids": [seq] if text else [],
    }
    values.update(fields)
    return Chunk(**values)  # type: ignore[arg-type]
