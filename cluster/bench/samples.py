"""What a load generator measures of one streamed reply, and the percentiles it reports.

Both clients of ``charserve bench`` (httpx in :mod:`cluster.bench.load`, and
:mod:`cluster.bench.lean_client`) feed a :class:`StreamTimer` with the decoded SSE events
they receive, so they measure alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Sample:
    """One request's measurements (seconds)."""

    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    events: int = 0  # decoded ``data:`` events, content or not ([DONE] excluded)
    status: int = 0  # the HTTP status (0: no response)
    start_s: float = 0.0  # when it was sent: ``time.perf_counter``, the system's monotonic clock

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first."""
        return (
            (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0
        )


class StreamTimer:
    """Times one streamed reply from its decoded SSE ``data:`` events; both load-generator
    clients (httpx and :mod:`cluster.bench.lean_client`) feed it, so they measure alike."""

    __slots__ = ("last", "parts", "sample")

    def __init__(self, start: float) -> None:
        self.sample = Sample(ok=False, start_s=start)
        self.last = start
        self.parts: list[str] = []

    def event(self, body: dict[str, Any], now: float) -> bool:
        """Record one event received at ``now``; False if it was an error event."""
        sample = self.sample
        sample.events += 1
        if "error" in body:
            sample.error = str(body["error"].get("message"))
            return False
        usage = body.get("usage")
        if usage:
            sample.output_tokens = int(usage["completion_tokens"])
            sample.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            sample.cached_tokens = int(details.get("cached_tokens") or 0)
        for choice in body.get("choices", ()):
            content = choice.get("delta", {}).get("content")
            if content:
                self.parts.append(content)
                if sample.ttft_s == 0.0:
                    sample.ttft_s = now - sample.start_s
                else:
                    sample.itl_s.append(now - self.last)
                self.last = now
        return True

    def finish(self, now: float) -> Sample:
        """The sample of a reply that ended at ``now``."""
        sample = self.sample
        sample.e2e_s = now - sample.start_s
        sample.text = "".join(self.parts)
        if not sample.error:
            sample.ok = sample.ttft_s > 0.0
            if not sample.ok:
                sample.error = "no content"
        return sample


def detailed(samples: list[Sample]) -> dict[str, list[Any]]:
    """Every request's start, TTFT and gaps (seconds) and error, in the shape of vLLM's
    benchmark client's ``--save-detailed`` fields, so each gap can be placed in time
    (say, in a window of the machine's CPU counters) by whatever reads either client's
    file; a failed request has an error and no times."""
    return {
        "start_times": [s.start_s for s in samples],
        "ttfts": [s.ttft_s if s.ok else 0.0 for s in samples],
        "itls": [s.itl_s if s.ok else [] for s in samples],
        "errors": ["" if s.ok else s.error or "failed" for s in samples],
    }


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
