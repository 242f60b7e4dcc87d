"""Pacing of batch starts: a token bucket that spreads batch prefills over engine steps.

Batch jobs tend to start in waves (a backfill submits many at once, and jobs of equal length
finish together). If a replica admitted a whole wave in one claim, vLLM would prefill all of
them in the next few steps, and every interactive request arriving meanwhile would wait
behind those long steps. Letting batch jobs start at a bounded rate keeps engine steps short
and even, so interactive time to first token stays close to one step, while batch slots
still fill up (in steady state batch jobs finish far slower than this rate).
"""

from __future__ import annotations

import time


class StartPacer:
    """A token bucket: ``rate_per_s`` starts per second, at most ``burst`` at once."""

    def __init__(self, rate_per_s: float, burst: int) -> None:
        self._rate = rate_per_s
        self._burst = float(burst)
        self._tokens = float(burst)
        self._at = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now

    def available(self) -> int:
        """Starts allowed now (0 when the rate is 0: pacing off means unlimited)."""
        if self._rate <= 0:
            return 1_000_000
        self._refill()
        return int(self._tokens)

    def take(self, n: int) -> None:
        """Record ``n`` starts."""
        if self._rate > 0 and n > 0:
            self._refill()
            self._tokens = max(0.0, self._tokens - n)

    def wait_s(self) -> float:
        """Seconds until the next start is allowed (0 if one is allowed now)."""
        if self._rate <= 0:
            return 0.0
        self._refill()
        return 0.0 if self._tokens >= 1 else (1 - self._tokens) / self._rate
