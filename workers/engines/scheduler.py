"""Latency-first engine steps: a vLLM scheduler that lets an interactive prefill run alone.

vLLM's ``priority`` policy orders its *waiting* queue, but once a request is running it is
batched with everything else: an interactive request that arrives beside a saturating batch
load shares its prefill step with every batch decode (and any batch prefill chunk), so its
time to first token grows with the batch. On a CPU, and on a GPU at large batch sizes, a
step's time grows with the tokens in it, so this is what stretched interactive TTFT under
backfill.

:class:`LatencyFirstScheduler` changes two things. First, while a latency-bound request (any class
but ``batch``) is waiting to be admitted or still prefilling, the step holds the batch
class back: running batch requests skip that step (vLLM's own mechanism for a request that
is not eligible this step, ``next_decode_eligible_step``, as its diffusion scheduler uses),
and no batch request is admitted in it. The interactive prefill then runs in a step about as
short as on an idle engine. Batch work loses one or two steps per interactive arrival and
keeps its KV blocks throughout, so nothing is recomputed. A bounded run of such steps
(``MAX_YIELD_STEPS``; then ordinary steps until no urgent prefill is pending) guarantees
batch progress even if an urgent request cannot be admitted (for example while KV blocks
are short), so the rule can never starve batch work or deadlock.

Second, while latency-bound requests are about (seen in the last
``LATENCY_TRAFFIC_WINDOW_S``), a step that carries batch work holds its decodes plus at most
``engine.batch_prefill_tokens`` prompt tokens (not vLLM's whole ``max_num_batched_tokens``),
so an interactive request that arrives while a step runs waits for a short one: the step it
waits behind is bounded, and the step after it is its own. On a CPU a prompt token costs
about as much as a decode of a whole sequence, so this bound matters. With no
latency-bound traffic, batch prefills run at vLLM's full chunk size.

The class travels in the request's vLLM priority: :func:`workers.engines.base.engine_priority`
keeps EDF order (the deadline in ms) and adds ``BATCH_PRIORITY_BASE`` for batch jobs, which
already sort after latency-bound ones (their budget is a day). Requests with no charserve
priority (a plain ``LLM.chat``, vLLM's own server) are all below the base, so for them this
scheduler behaves exactly like vLLM's.
"""

from __future__ import annotations

import os
import time
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from cluster.errors import ConfigError
from cluster.runtime.introspect import missing_names
from workers.engines import steplog
from workers.engines.base import BATCH_PRIORITY_BASE
from workers.engines.config import BATCH_PREFILL_ENV
from workers.engines.engine_wait import set_nice, spin_wanted, stop_spinning, wanted_nice

# Consecutive steps batch work may be held back before ordinary steps resume.
MAX_YIELD_STEPS = 8
# Batch prefills are capped while latency-bound requests were seen this recently.
LATENCY_TRAFFIC_WINDOW_S = 10.0


# What this module reads and overrides inside vLLM's scheduler, a private interface:
# attributes its schedule() must read (or an override would silently do nothing), and
# attributes a Request must carry.
SCHEDULER_READS = (
    "max_num_active_reqs",
    "max_num_scheduled_tokens",
    "next_decode_eligible_step",
    "current_step",
    "running",
    "waiting",
)
REQUEST_HAS = ("next_decode_eligible_step", "num_computed_tokens", "num_prompt_tokens", "priority")


class SchedulerApiMismatch(ConfigError):
    """The installed vLLM's scheduler is not the one latency-first steps were written for."""


def check_scheduler_api(
    scheduler: type[Scheduler] = Scheduler, request: type[Request] = Request
) -> None:
    """Raise :class:`SchedulerApiMismatch` unless ``scheduler.schedule`` reads every name
    of :data:`SCHEDULER_READS` and ``request`` sets every one of :data:`REQUEST_HAS`.

    Called when a replica's engine builds its scheduler, so a vLLM that renamed or dropped
    one fails the replica's start with this message, not the first request (or, worse,
    runs with an override that does nothing)."""
    missing = missing_names(scheduler.schedule, SCHEDULER_READS)
    missing += [f"Request.{n}" for n in missing_names(request.__init__, REQUEST_HAS)]
    if missing:
        import vllm

        raise SchedulerApiMismatch(
            f"vLLM {getattr(vllm, '__version__', '?')}'s scheduler no longer has what "
            f"latency-first steps use ({', '.join(missing)}); install the vLLM version "
            "charserve pins, or set engine.latency_first_steps: false"
        )


def is_batch(request: Request) -> bool:
    """True for a request charserve submitted in the batch class."""
    return request.priority >= BATCH_PRIORITY_BASE


def _prefilling(request: Request) -> bool:
    return request.num_computed_tokens < request.num_prompt_tokens


class _LatencyFirst:
    """The rule, as a mixin over vLLM's synchronous or asynchronous scheduler."""

    running: list[Request]
    current_step: int
    max_num_active_reqs: int
    max_num_scheduled_tokens: int
    _yield_steps: int = 0
    _batch_prefill_tokens: int | None = None
    _latency_seen_s: float = float("-inf")

    def _prefill_cap(self) -> int:
        if self._batch_prefill_tokens is None:
            self._batch_prefill_tokens = int(os.environ.get(BATCH_PREFILL_ENV, "0") or 0)
        return self._batch_prefill_tokens

    def _note_latency_traffic(self) -> bool:
        """True while latency-bound requests were present within the last window."""
        waiting = self.waiting  # type: ignore[attr-defined]
        now = time.monotonic()
        if any(not is_batch(r) for r in self.running) or (
            waiting and not is_batch(waiting.peek_request())
        ):
            self._latency_seen_s = now
        return now - self._latency_seen_s < LATENCY_TRAFFIC_WINDOW_S

    def _has_batch_work(self) -> bool:
        if any(is_batch(r) for r in self.running):
            return True
        waiting = self.waiting  # type: ignore[attr-defined]
        return bool(waiting) and is_batch(waiting.peek_request())

    def _urgent_waiting(self) -> int:
        # The waiting queue is a heap in priority order: urgent requests come first.
        count = 0
        for request in self.waiting:  # type: ignore[attr-defined]
            if is_batch(request):
                break
            count += 1
        return count

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        cap = self.max_num_active_reqs
        urgent_waiting = self._urgent_waiting() if len(self.running) < cap else 0
        urgent_prefill = urgent_waiting > 0 or any(
            not is_batch(r) and _prefilling(r) for r in self.running
        )
        held = [r for r in self.running if is_batch(r)] if urgent_prefill else []
        if not held:
            self._yield_steps = 0
            if (
                urgent_prefill
                or not self._prefill_cap()
                or not self._note_latency_traffic()
                or not self._has_batch_work()
            ):
                return super().schedule(throttle_prefills)  # type: ignore[misc]
            return self._capped_step(throttle_prefills)
        if self._yield_steps >= MAX_YIELD_STEPS:
            # Held back long enough: ordinary steps until no urgent prefill is pending.
            return super().schedule(throttle_prefills)  # type: ignore[misc]
        self._yield_steps += 1
        # schedule() advances current_step before it checks eligibility, so +2 skips
        # exactly this call; max() keeps any longer wait vLLM itself set.
        for request in held:
            request.next_decode_eligible_step = max(
                request.next_decode_eligible_step, self.current_step + 2
            )
        # Admit the urgent requests (they head the waiting queue) and no batch request.
        self.max_num_active_reqs = min(cap, len(self.running) + urgent_waiting)
        try:
            return super().schedule(throttle_prefills)  # type: ignore[misc]
        finally:
            self.max_num_active_reqs = cap

    def _capped_step(self, throttle_prefills: bool) -> SchedulerOutput:
        # A step with batch work: every running request's decode plus at most the cap of
        # prompt tokens, so a latency-bound request arriving now waits for a short step.
        budget = self.max_num_scheduled_tokens
        decodes = sum(1 for r in self.running if not _prefilling(r))
        self.max_num_scheduled_tokens = min(budget, decodes + self._prefill_cap())
        try:
            return super().schedule(throttle_prefills)  # type: ignore[misc]
        finally:
            self.max_num_scheduled_tokens = budget


class LatencyFirstScheduler(_LatencyFirst, Scheduler):
    """vLLM's scheduler with latency-first steps (synchronous scheduling: the CPU engine)."""


class LatencyFirstAsyncScheduler(_LatencyFirst, AsyncScheduler):
    """vLLM's asynchronous scheduler with latency-first steps (CUDA, where vLLM enables it)."""


def latency_first_scheduler(*, vllm_config: VllmConfig, **kwargs: Any) -> Scheduler:
    """vLLM's ``scheduler_cls`` hook: the variant matching the scheduling vLLM resolved.

    vLLM decides asynchronous scheduling from the platform and executor (off on the CPU,
    on for most CUDA setups), after the engine arguments are read, so the choice is made
    here, when the engine core builds its scheduler. With ``CHARSERVE_STEP_LOG`` set it
    logs every step (:mod:`workers.engines.steplog`).
    """
    check_scheduler_api()
    if not spin_wanted():
        # Built after the executor: its queue readers exist, and poll with sleeps from now on.
        stop_spinning()
    nice = wanted_nice()
    if nice is not None:
        # Built after the executor: its model workers were started and keep their priority.
        set_nice(nice)
    cls: type[Scheduler] = (
        LatencyFirstAsyncScheduler
        if vllm_config.scheduler_config.async_scheduling
        else LatencyFirstScheduler
    )
    if steplog.from_environment() is not None:
        cls = steplog.with_step_log(cls)
    return cls(vllm_config=vllm_config, **kwargs)
