"""Wall-clock time shared across machines.

Deadlines, arrivals and heartbeats are wall-clock milliseconds, because they are compared
by processes on other hosts; durations inside one process use ``time.perf_counter`` or
``time.monotonic`` instead.
"""

from __future__ import annotations

import time


def now_ms() -> int:
    """Wall-clock milliseconds since the epoch."""
    return time.time_ns() // 1_000_000
