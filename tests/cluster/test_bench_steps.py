"""Step logs read back: a run's window of steps, and what they show of how the streams
reached the engine."""

from __future__ import annotations

import math
from pathlib import Path

from cluster.bench.steps import carries_prompt, step_in_flight, summarise
from cluster.runtime.steplog import Step, line, parse, read_steps


def test_a_log_reads_back_as_written_and_a_line_being_written_is_left_out() -> None:
    steps = [Step(1.5, 80, 1, 80, 1), Step(1.6, 2, 0, 0, 2)]
    text = "".join(line(s) for s in steps)
    assert parse(text) == steps
    assert parse(text + "1.7\t3\t0") == steps  # cut mid-line by a reader


def test_the_window_selects_steps_across_every_process_log_in_order(tmp_path: Path) -> None:
    (tmp_path / "steps-1.tsv").write_text(line(Step(1.0, 1, 0, 0, 1)) + line(Step(3.0, 1, 0, 0, 1)))
    (tmp_path / "steps-2.tsv").write_text(line(Step(2.0, 5, 1, 5, 1)) + line(Step(9.0, 1, 0, 0, 1)))
    (tmp_path / "other.txt").write_text(line(Step(2.5, 1, 0, 0, 1)))
    assert [s.at_s for s in read_steps(tmp_path, 1.5, 3.0)] == [2.0, 3.0]
    assert read_steps(tmp_path / "missing", 0.0, 10.0) == []


def test_a_group_arriving_beside_running_decodes_stalls_them() -> None:
    # One stream first; 3 arrive while it decodes (it waits for their prefill), then all
    # 4 decode: 1 of the 4 + 3 + 4 + 4 decodes waited, in a step of its own.
    steps = [
        Step(0.00, 50, 1, 50, 1),
        Step(0.05, 151, 3, 150, 4),
        Step(0.20, 4, 0, 0, 4),
        Step(0.24, 4, 0, 0, 4),
        Step(0.28, 4, 0, 0, 4),
    ]
    s = summarise(steps)
    assert s["steps"] == 5 and s["arrival_steps"] == 2
    assert s["arrivals"] == "1×1 3×1"
    decodes = 0 + 1 + 4 + 4 + 4
    assert s["stalled_pct"] == round(100 * 1 / decodes, 2)
    # Only the gaps after steps that started nothing: 40 ms each.
    assert s["decode_step_ms"] == 40.0
    # 1 request for 50 ms, 4 for the 230 ms after it, over 280 ms.
    assert s["running_mean"] == round((1 * 0.05 + 4 * 0.23) / 0.28, 1)


def test_no_steps_summarise_to_nothing_and_one_step_has_no_decode_time() -> None:
    assert summarise([]) == {}
    one = summarise([Step(0.0, 4, 0, 0, 4)])
    assert one["stalled_pct"] == 0.0 and math.isnan(float(one["decode_step_ms"]))
    assert math.isnan(float(one["running_mean"]))


def test_a_step_carries_prompt_tokens_when_it_has_more_tokens_than_requests() -> None:
    assert carries_prompt(Step(0.0, 48 + 64, 1, 60, 49))
    assert not carries_prompt(Step(0.0, 48, 0, 0, 48))


def test_requests_wait_for_the_step_in_flight_and_see_whether_it_carried_prompts() -> None:
    # Batch decodes alone take 100 ms a step; with 64 prompt tokens in them, 170 ms.
    steps = [
        Step(0.00, 48, 0, 0, 48),
        Step(0.10, 112, 1, 60, 49),
        Step(0.27, 49, 0, 0, 49),
        Step(0.37, 113, 1, 64, 50),
        Step(0.54, 50, 0, 0, 50),
    ]
    # Sent 20 ms into a decode step, then 20 and 100 ms into a prompt step (waits of 80,
    # 150 and 70 ms); one sent before the first step and one after the last are left out.
    sent = [0.02, 0.39, 0.47, -1.0, 0.60]
    out = step_in_flight([(steps, sent)])
    assert out["step_wait_ms_p50"] == 80.0
    assert out["step_wait_ms_p99"] == 148.6  # between 80 and 150, interpolated
    assert out["in_flight_with_prompts_pct"] == round(100 * 2 / 3, 1)
    assert out["steps_with_prompts_pct"] == 50.0
    assert out["prompt_step_ms"] == 170.0
    assert out["decode_only_step_ms"] == 100.0


def test_windows_pool_their_requests_and_no_step_pairs_across_two_of_them() -> None:
    first = [Step(0.0, 4, 0, 0, 4), Step(0.1, 4, 0, 0, 4)]
    second = [Step(50.0, 68, 1, 64, 5), Step(50.2, 5, 0, 0, 5)]
    out = step_in_flight([(first, [0.05, 0.2]), (second, [50.1])])
    # 0.2 is after the first window's last step: its next step is not the second's.
    assert out["step_wait_ms_p50"] == 75.0
    assert out["in_flight_with_prompts_pct"] == 50.0
    assert out["decode_only_step_ms"] == 100.0 and out["prompt_step_ms"] == 200.0
    assert step_in_flight([(first, [])]) == {} and step_in_flight([]) == {}
