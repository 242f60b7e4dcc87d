"""CPU steal over a benchmark run's window, from /proc/stat's counters."""

from __future__ import annotations

import math
from pathlib import Path

from cluster.bench.load import summarize
from cluster.bench.samples import Sample, detailed
from cluster.bench.steal import (
    StealTotals,
    gaps_in_clean_windows,
    parse_cpu_times,
    per_core,
    read_cpu_times,
    steal_percent,
    window_peaks,
    window_steal,
)

STAT = """cpu  100 0 50 800 10 0 5 35 7 0
cpu0 60 0 30 390 5 0 3 12 7 0
cpu1 40 0 20 410 5 0 2 23 0 0
intr 1 2 3
ctxt 99
"""


def _stat(cpu0: tuple[int, int], cpu1: tuple[int, int]) -> dict[str, tuple[int, int]]:
    return {
        "cpu": (cpu0[0] + cpu1[0], cpu0[1] + cpu1[1]),
        "cpu0": cpu0,
        "cpu1": cpu1,
    }


def test_a_cores_time_is_its_first_eight_columns_and_guest_is_not_counted_twice() -> None:
    times = parse_cpu_times(STAT)
    assert times == {"cpu": (1000, 35), "cpu0": (500, 12), "cpu1": (500, 23)}


def test_steal_is_the_stolen_share_of_each_lines_time_between_two_readings() -> None:
    before = _stat((500, 12), (500, 23))
    after = _stat((700, 22), (700, 83))
    shares = steal_percent(before, after)
    assert shares["cpu0"] == 5.0 and shares["cpu1"] == 30.0
    assert shares["cpu"] == 17.5
    assert per_core(shares) == [5.0, 30.0]


def test_counters_that_did_not_advance_give_nan_and_a_missing_line_is_skipped() -> None:
    before = {"cpu0": (500, 12)}
    after = {"cpu0": (500, 12), "cpu1": (900, 40)}
    shares = steal_percent(before, after)
    assert set(shares) == {"cpu0"} and math.isnan(shares["cpu0"])


def test_cores_are_in_numeric_order_past_ten() -> None:
    shares = {"cpu": 1.0, **{f"cpu{i}": float(i) for i in range(12)}}
    assert per_core(shares) == [float(i) for i in range(12)]


def test_the_window_spans_the_readings_around_it() -> None:
    readings = [
        (0.0, _stat((0, 0), (0, 0))),
        (1.0, _stat((100, 50), (100, 50))),  # before the window: a stolen second
        (2.0, _stat((200, 50), (200, 50))),
        (3.0, _stat((300, 60), (300, 70))),
        (4.0, _stat((400, 60), (400, 70))),
        (5.0, _stat((500, 160), (500, 170))),  # after the window
    ]
    shares = window_steal(readings, 1.5, 3.5)
    # From the reading at 1.0 to the one at 4.0: 300 jiffies a core, 10 and 20 stolen.
    assert shares["cpu0"] == 100 * 10 / 300 and shares["cpu1"] == 100 * 20 / 300
    # A window past the readings uses the last; one before them, the first.
    assert window_steal(readings, 4.5, 9.0)["cpu0"] == 100.0
    assert window_steal(readings, -1.0, 0.5)["cpu0"] == 50.0
    assert window_steal(readings[:1], 0.0, 1.0) == {}


def test_a_machine_without_proc_stat_reads_nothing(tmp_path: Path) -> None:
    assert read_cpu_times(tmp_path / "missing") == {}
    assert window_steal([(0.0, {}), (1.0, {})], 0.0, 1.0) == {}


def test_spans_of_one_target_sum_their_time_before_the_share_is_taken() -> None:
    totals = StealTotals()
    totals.add(_stat((0, 0), (0, 0)), _stat((100, 10), (100, 0)))
    # Another target's round ran between these readings: not counted here.
    totals.add(_stat((500, 90), (500, 90)), _stat((800, 90), (800, 90)))
    shares = totals.percent()
    assert shares["cpu0"] == 2.5 and shares["cpu1"] == 0.0 and shares["cpu"] == 1.25


def test_charserve_bench_reports_the_steal_over_its_rounds_and_not_without_counters() -> None:
    totals = StealTotals()
    totals.add(_stat((0, 0), (0, 0)), _stat((400, 4), (400, 40)))
    report = summarize([], 1.0, steal=totals)
    assert report["cpu_steal_pct"] == 5.5 and report["cpu_steal_pct_cores"] == [1.0, 10.0]
    assert "cpu_steal_pct" not in summarize([], 1.0, steal=StealTotals())
    assert "cpu_steal_pct" not in summarize([], 1.0)


def test_a_window_is_as_stolen_as_its_most_stolen_core() -> None:
    readings = [
        (0.0, _stat((0, 0), (0, 0))),
        (0.5, _stat((50, 0), (50, 10))),  # core 1 lost a fifth
        (1.0, _stat((100, 1), (100, 10))),  # core 0 lost a fiftieth
        (1.5, _stat((100, 1), (150, 10))),  # core 0's counters did not advance
    ]
    peaks = window_peaks(readings)
    assert peaks[:2] == [20.0, 2.0] and math.isnan(peaks[2])
    assert window_peaks([(0.0, {"cpu": (0, 0)}), (1.0, {"cpu": (100, 3)})]) == [3.0]


def test_gaps_are_placed_by_when_they_ended_and_only_clean_windows_keep_theirs() -> None:
    readings = [
        (10.0, _stat((0, 0), (0, 0))),
        (11.0, _stat((100, 0), (100, 1))),  # clean: 1% at most
        (12.0, _stat((200, 0), (200, 31))),  # stolen: 30% of core 1
        (13.0, _stat((300, 0), (300, 31))),  # clean
    ]
    record = {
        # Sent at 10.2, first token at 10.4: gaps ending at 10.5, 11.5, 12.9 and 13.4
        # (after the last reading: not placed).
        "start_times": [10.2, 10.0],
        "ttfts": [0.2, 0.5],
        "itls": [[0.1, 1.0, 1.4, 0.5], [0.25]],
        "errors": ["", "Too Many Requests"],  # a refused request's times are not gaps
    }
    clean, placed = gaps_in_clean_windows(readings, record, below_pct=2.0)
    assert placed == 3
    assert clean == [0.1, 1.4]
    # Strictly below: a window with exactly the bound stolen is not clean.
    assert gaps_in_clean_windows(readings, record, below_pct=1.0) == ([1.4], 3)


def test_our_detailed_record_has_the_shape_of_vllms_clients() -> None:
    ok = Sample(ok=True, ttft_s=0.2, itl_s=[0.1, 0.3], start_s=5.0)
    refused = Sample(ok=False, ttft_s=0.0, error="HTTP 429", start_s=6.0)
    record = detailed([ok, refused])
    assert record == {
        "start_times": [5.0, 6.0],
        "ttfts": [0.2, 0.0],
        "itls": [[0.1, 0.3], []],
        "errors": ["", "HTTP 429"],
    }
    readings = [(4.0, _stat((0, 0), (0, 0))), (7.0, _stat((100, 0), (100, 0)))]
    assert gaps_in_clean_windows(readings, record, below_pct=2.0) == ([0.1, 0.3], 2)
