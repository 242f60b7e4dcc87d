"""CPU steal: the share of a core's time the hypervisor ran someone else instead.

On a virtual machine a run can lose part of its cores to other guests, and a latency
benchmark then reads that time as the server's own stall. Linux counts it per core in
``/proc/stat`` (the ``steal`` column), so a benchmark reads the counters beside each run
and reports what was taken, and a run under steal is not read as the server's cost. Where
``/proc/stat`` is missing (not Linux) the readings are empty and the share is NaN.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROC_STAT = Path("/proc/stat")
# /proc/stat's cpu columns: user nice system idle iowait irq softirq steal guest guest_nice.
# guest and guest_nice are already counted in user and nice, so a core's time is the first 8.
_TIME_COLUMNS = 8
_STEAL = 7
NAN = float("nan")

# One reading: per cpu line ("cpu" for all cores, then "cpu0", "cpu1", ...), the jiffies of
# its time and of its stolen time since boot.
CpuTimes = dict[str, tuple[int, int]]


def parse_cpu_times(text: str) -> CpuTimes:
    """The ``cpu`` lines of a ``/proc/stat`` page: (time, stolen time) per line."""
    times: CpuTimes = {}
    for line in text.splitlines():
        if not line.startswith("cpu"):
            continue
        name, *columns = line.split()
        values = [int(v) for v in columns[:_TIME_COLUMNS]]
        if len(values) > _STEAL:
            times[name] = (sum(values), values[_STEAL])
    return times


def read_cpu_times(path: Path = PROC_STAT) -> CpuTimes:
    """This machine's counters now, or ``{}`` where it has no ``/proc/stat``."""
    try:
        return parse_cpu_times(path.read_text())
    except OSError:
        return {}


@dataclass(slots=True)
class StealTotals:
    """Time and stolen time per cpu line, summed over spans (say, the rounds one target
    of ``charserve bench`` ran, between which another target ran)."""

    spans: dict[str, tuple[int, int]] = field(default_factory=dict)

    def add(self, before: CpuTimes, after: CpuTimes) -> None:
        """Add the span between two readings, for the lines in both."""
        for name, (total_after, steal_after) in after.items():
            if name in before:
                total, steal = self.spans.get(name, (0, 0))
                self.spans[name] = (
                    total + total_after - before[name][0],
                    steal + steal_after - before[name][1],
                )

    def percent(self) -> dict[str, float]:
        """Per line, the percentage of its time stolen over the spans (NaN for a line
        whose counters did not advance)."""
        return {
            name: 100.0 * steal / total if total > 0 else NAN
            for name, (total, steal) in self.spans.items()
        }


def steal_percent(before: CpuTimes, after: CpuTimes) -> dict[str, float]:
    """Per cpu line in both readings, the percentage of its time stolen between them
    (NaN for a line whose counters did not advance)."""
    totals = StealTotals()
    totals.add(before, after)
    return totals.percent()


def steal_fields(shares: dict[str, float]) -> dict[str, Any]:
    """A benchmark report's fields for :func:`steal_percent`'s shares: ``cpu_steal_pct``
    (all cores) and ``cpu_steal_pct_cores`` (each core's, in order), rounded; none where
    there were no counters."""
    if "cpu" not in shares:
        return {}
    return {
        "cpu_steal_pct": round(shares["cpu"], 2),
        "cpu_steal_pct_cores": [round(v, 2) for v in per_core(shares)],
    }


def steal_since(before: CpuTimes) -> dict[str, Any]:
    """:func:`steal_fields` for the span from ``before`` (a :func:`read_cpu_times`
    reading) to now: a benchmark phase's CPU steal."""
    return steal_fields(steal_percent(before, read_cpu_times()))


def window_steal(
    readings: list[tuple[float, CpuTimes]], start_s: float, end_s: float
) -> dict[str, float]:
    """The steal percentages over ``[start_s, end_s]`` from readings taken in time order
    (monotonic seconds): from the last reading at or before the start (else the first) to
    the first at or after the end (else the last), so the span covers the window."""
    if len(readings) < 2:
        return {}
    times = [t for t, _ in readings]
    first = max(bisect.bisect_right(times, start_s) - 1, 0)
    last = min(bisect.bisect_left(times, end_s), len(readings) - 1)
    if last <= first:
        return {}
    return steal_percent(readings[first][1], readings[last][1])


def per_core(shares: dict[str, float]) -> list[float]:
    """The per-core values of :func:`steal_percent`, in core order (``cpu0``, ``cpu1``, ...)."""
    cores = [(int(name[3:]), v) for name, v in shares.items() if name[3:].isdigit()]
    return [v for _, v in sorted(cores)]


def window_peaks(readings: list[tuple[float, CpuTimes]]) -> list[float]:
    """Between each two consecutive readings, the highest steal percentage of any one core
    (of all cores where the readings have no per-core lines; NaN where nothing advanced):
    a window is clean only if no core the server runs on was taken from."""
    peaks = []
    for (_, before), (_, after) in itertools.pairwise(readings):
        shares = steal_percent(before, after)
        cores = per_core(shares) or [shares.get("cpu", NAN)]
        peaks.append(max(cores) if all(v == v for v in cores) else NAN)
    return peaks


def gaps_in_clean_windows(
    readings: list[tuple[float, CpuTimes]],
    detailed: dict[str, list[Any]],
    below_pct: float,
) -> tuple[list[float], int]:
    """The inter-token gaps (s) of a client's per-request record (vLLM's client's
    ``--save-detailed`` fields: ``start_times``, ``ttfts``, ``itls``, ``errors``; times on
    the readings' monotonic clock) that ended between two consecutive readings in which no
    core had ``below_pct`` percent or more of its time stolen; and how many gaps ended
    between readings at all. The tail of the clean gaps is the servers' own, with the
    hypervisor's stalls left out."""
    times = [t for t, _ in readings]
    peaks = window_peaks(readings)
    clean: list[float] = []
    placed = 0
    for start, ttft, itls, error in zip(
        detailed["start_times"], detailed["ttfts"], detailed["itls"], detailed["errors"],
        strict=True,
    ):  # fmt: skip
        if error:
            continue
        end = start + ttft
        for gap in itls:
            end += gap
            i = bisect.bisect_right(times, end) - 1
            if 0 <= i < len(peaks):
                placed += 1
                if peaks[i] < below_pct:
                    clean.append(gap)
    return clean, placed
