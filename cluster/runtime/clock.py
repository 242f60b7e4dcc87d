"""Time shared across machines: Redis's clock.

Deadlines, arrivals, heartbeats and leases are compared by processes on other hosts, so
they are all read on one clock, Redis's (``TIME``). Each process keeps a
:class:`RedisClock`: the offset of Redis's time from its own wall clock, refreshed with
every round trip that reads ``TIME`` anyway (a worker's claims and heartbeats, a gateway's
capacity refresh). A process whose own clock is minutes off still stamps deadlines and
judges expiry and freshness as Redis does. Durations inside one process use
``time.perf_counter`` or ``time.monotonic`` instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def now_ms() -> int:
    """This machine's wall-clock milliseconds since the epoch."""
    return time.time_ns() // 1_000_000


class RedisClock:
    """Redis's time, read locally: this machine's clock plus the last measured offset."""

    __slots__ = ("_local", "offset_ms")

    def __init__(self, local: Callable[[], int] | None = None) -> None:
        # None: this machine's wall clock (looked up at each reading).
        self._local = local
        self.offset_ms = 0

    def _local_ms(self) -> int:
        return self._local() if self._local is not None else now_ms()

    def now_ms(self) -> int:
        """Redis's time now, in ms (this machine's until the first :meth:`observe`)."""
        return self._local_ms() + self.offset_ms

    def observe(self, redis_ms: int) -> None:
        """Note that Redis's clock read ``redis_ms`` just now (a ``TIME`` reply, or a
        script's ``now``); later readings follow it."""
        self.offset_ms = redis_ms - self._local_ms()

    @staticmethod
    def from_time_reply(reply: tuple[int, int] | list[int]) -> int:
        """The ms of a ``TIME`` reply (seconds, microseconds)."""
        seconds, micros = reply
        return int(seconds) * 1000 + int(micros) // 1000
