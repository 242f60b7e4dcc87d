"""The batch reserve: slots batch work leaves free for latency-bound (interactive, standard)
work, fixed or following the demand.

A fixed reserve is a compromise: large enough for an interactive burst, it caps a backfill
far below the engine's batch when no one is chatting; small, a burst of chats waits for
batch jobs to finish. The adaptive reserve keeps ``headroom`` slots above the most
latency-bound jobs seen in flight over the last ``window_s`` seconds, between ``least`` and
``most``. With no chat traffic batch work may use all but ``least`` slots; once chats
arrive, batch jobs that finish are not replaced until the reserve covers their peak again.
The reserve only shrinks after a whole window without that peak, so a lull between chats
does not hand their slots to batch jobs that then hold them for many seconds.
"""

from __future__ import annotations

import time
from collections import deque


class BatchReserve:
    """Slots batch work may not take: ``most`` always, unless ``least`` makes it adaptive."""

    def __init__(
        self, most: int, least: int | None = None, window_s: float = 30.0, headroom: int = 2
    ) -> None:
        self._most = most
        self._least = most if least is None else min(least, most)
        self._window_s = window_s
        self._headroom = headroom
        self._seen: deque[tuple[float, int]] = deque()
        self._now = 0

    @property
    def adaptive(self) -> bool:
        """True if the reserve follows demand."""
        return self._least < self._most

    def note(self, latency_bound_in_flight: int) -> None:
        """Record the latency-bound jobs in flight now (call whenever it changes)."""
        self._now = latency_bound_in_flight
        if self.adaptive:
            # A sliding-window maximum: counts kept in decreasing order, so the oldest
            # entry still inside the window is the peak.
            while self._seen and self._seen[-1][1] <= latency_bound_in_flight:
                self._seen.pop()
            self._seen.append((time.monotonic(), latency_bound_in_flight))

    def slots(self) -> int:
        """Slots batch work must leave free now."""
        if not self.adaptive:
            return self._most
        horizon = time.monotonic() - self._window_s
        while self._seen and self._seen[0][0] < horizon:
            self._seen.popleft()
        peak = max(self._seen[0][1] if self._seen else 0, self._now)
        if peak == 0:
            return self._least
        return max(self._least, min(self._most, peak + self._headroom))
