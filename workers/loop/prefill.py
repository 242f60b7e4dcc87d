"""What a worker learns about its engine's prefills, and reports for admission.

A worker reports three figures with its stats (``cluster.wire.protocol.WorkerStats``):

- ``prefill_ms``: what one short prompt's prefill takes, from claim to first token. Each
  prefill's time is divided by the prefills it shared the engine with (a wave of 32
  arrivals waits for its first tokens together), and the figure is their recent average.
- ``prefill_ms_per_token``: the engine's recent cost of a prompt token when it prefills
  many together. The cost of an uncached token is learnt from busy periods (chat prefills
  pending without a break) of at least ``PER_TOKEN_MIN_TOKENS`` uncached tokens: their
  time over their tokens, in sums that weigh recent periods most. A short prompt alone
  teaches nothing: its time is the step it joins, not its tokens. A prompt token costs
  that times the recent uncached share of chat prompts, since the prefix cache serves the
  rest and the engine's count of cached tokens comes with the first token only.
- ``prefill_queued_ms``: the prompt tokens awaiting their prefill now, at that cost: what a
  chat arriving now waits for before its own prompt is prefilled.

Why tokens, not prefills: the engine prefills a wave's prompts in one or two steps, so a
wave costs its tokens, not its count times one prefill alone. An estimate of one prefill's
time times the prefills waiting put a closed loop of 32 chats at 2.5 to 3.2 s each, and
refused some, where they took 1.1 to 1.5 s (docs/benchmarks.md).

Batch prefills are left out of the queued tokens and of what is learnt: a chat's prefill
goes before them (the engine schedules by priority), and long batch prompts (multi-turn
backfills) must not make chats look infeasible.

All figures fade once samples stop coming (``fade``): refused work brings no new samples,
so a burst's figure must not refuse work for ever, yet an idle cluster still knows
roughly what a prefill costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The figures hold for this long after the last sample, then fade with this time constant.
PREFILL_FRESH_S = 5.0
PREFILL_FADE_S = 30.0
# The least uncached tokens a busy period teaches the cost of a token from (a 50-token
# prompt alone in a 100 ms step says 2 ms a token, and would make a 1,000-token prompt
# look 2 s long).
PER_TOKEN_MIN_TOKENS = 256
# Under load that never lets the pending prefills drain, the period so far is learnt from
# every this many uncached tokens (a wave's first tokens come out of one step together, so
# a period cut short would teach its rest as free: the sums keep the two parts together).
PER_TOKEN_SAMPLE_TOKENS = 16 * PER_TOKEN_MIN_TOKENS
# The weight of a new sample in the moving averages.
SMOOTHING = 0.2


def fade(now_s: float, last_sample_s: float) -> float:
    """1 while the last sample is recent (``PREFILL_FRESH_S``), then decaying."""
    age_s = now_s - last_sample_s
    if age_s <= PREFILL_FRESH_S:
        return 1.0
    return math.exp(-(age_s - PREFILL_FRESH_S) / PREFILL_FADE_S)


def _smoothed(average: float, sample: float) -> float:
    return sample if average == 0.0 else average + SMOOTHING * (sample - average)


@dataclass(frozen=True, slots=True)
class PrefillReport:
    """The three figures a worker reports (ms, ms per token, ms)."""

    prefill_ms: float
    prefill_ms_per_token: float
    prefill_queued_ms: float


class PrefillMeter:
    """The jobs awaiting their first token, and what their prefills have taken.

    ``started`` when a job goes to the engine; ``first_token`` when its first output comes;
    ``ended`` when it ends without one. Times are the caller's monotonic seconds.
    """

    def __init__(self) -> None:
        # Job id -> the prompt tokens it puts before a chat arriving now (0 for batch), and
        # the prefills it started beside, itself included.
        self._pending: dict[str, tuple[int, int]] = {}
        self._queued_tokens = 0  # their tokens: 0 exactly when no chat prefill is pending
        self._per_prefill_ms = 0.0
        # Recent busy periods' time (ms) and uncached tokens, each weighted down by
        # SMOOTHING as a newer one is added: their ratio is the cost of a token.
        self._busy_ms_sum = 0.0
        self._busy_tokens_sum = 0.0
        self._uncached_share = 1.0
        self._last_sample_s = 0.0
        # The current busy period: since when chat prefills are pending, the uncached
        # tokens prefilled in it so far, and whether part of it was learnt already.
        self._busy_since_s = 0.0
        self._busy_tokens = 0
        self._busy_learnt = False

    @property
    def pending(self) -> int:
        """Jobs awaiting their first token."""
        return len(self._pending)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._pending

    def started(self, job_id: str, prompt_tokens: int, chat: bool, now_s: float) -> int:
        """Note a job handed to the engine; returns the prefills it starts beside, itself
        included."""
        tokens = prompt_tokens if chat else 0
        if tokens and not self._queued_tokens:
            self._busy_since_s, self._busy_tokens, self._busy_learnt = now_s, 0, False
        self._queued_tokens += tokens
        contenders = len(self._pending) + 1
        self._pending[job_id] = (tokens, contenders)
        return contenders

    def first_token(self, job_id: str, prefill_ms: float, uncached: int, now_s: float) -> None:
        """Learn from a job's first token, ``prefill_ms`` after it started, with
        ``uncached`` prompt tokens the prefix cache did not hold."""
        tokens, contenders = self._pending.get(job_id, (0, 1))
        # Shared with those before it and those that joined since (still waiting now, or
        # coming out of this same step), itself included.
        shared = max(contenders, len(self._pending))
        self._forget(job_id)
        if not tokens:
            return  # batch work, or a job already forgotten
        self._last_sample_s = now_s
        self._per_prefill_ms = _smoothed(self._per_prefill_ms, prefill_ms / shared)
        self._uncached_share = _smoothed(self._uncached_share, min(1.0, uncached / tokens))
        self._busy_tokens += uncached
        drained = not self._queued_tokens
        if self._busy_tokens >= PER_TOKEN_SAMPLE_TOKENS or (
            drained and (self._busy_learnt or self._busy_tokens >= PER_TOKEN_MIN_TOKENS)
        ):
            keep = 1.0 - SMOOTHING if self._busy_tokens_sum else 0.0
            busy_ms = (now_s - self._busy_since_s) * 1000.0
            self._busy_ms_sum = keep * self._busy_ms_sum + busy_ms
            self._busy_tokens_sum = keep * self._busy_tokens_sum + self._busy_tokens
            self._busy_since_s, self._busy_tokens, self._busy_learnt = now_s, 0, True

    def ended(self, job_id: str) -> bool:
        """Forget a job that ended before its first token; whether it was pending."""
        if job_id not in self._pending:
            return False
        self._forget(job_id)
        return True

    def _forget(self, job_id: str) -> None:
        tokens, _ = self._pending.pop(job_id, (0, 0))
        self._queued_tokens -= tokens

    def report(self, now_s: float) -> PrefillReport:
        """The figures as a chat arriving at ``now_s`` would see them."""
        weight = fade(now_s, self._last_sample_s)
        learnt = self._busy_tokens_sum
        per_uncached = self._busy_ms_sum / learnt if learnt else 0.0
        per_token = per_uncached * self._uncached_share * weight
        return PrefillReport(
            prefill_ms=self._per_prefill_ms * weight,
            prefill_ms_per_token=per_token,
            prefill_queued_ms=per_token * self._queued_tokens,
        )
