"""``charserve bench-mixed`` against a real gateway: every phase runs and reports."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from cluster.bench.mixed import PHASES, add_arguments, bench_mixed, round_order
from cluster.runtime.steplog import Step, line
from tests.gateway.conftest import Gateway


def _args(gateway: Gateway, *extra: str) -> argparse.Namespace:
    """A brief, light load against the test gateway."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(
        ["--base-url", gateway.base_url, "--labels", "edf", "--rate", "10",
         "--batch-concurrency", "2", "--batch-max-tokens", "4",
         "--interactive-max-tokens", "2", *extra]
    )  # fmt: skip


async def test_every_phase_serves_both_classes_and_reports_its_cpu_steal(
    gateway: Gateway,
) -> None:
    result = await bench_mixed(_args(gateway, "--duration", "0.6"))
    phases = result["results"]["edf"]
    assert set(phases) == {"interactive_only", "batch_only", "mixed"}
    assert phases["interactive_only"]["batch_requests"] == 0
    assert phases["batch_only"]["interactive_requests"] == 0
    for name, phase in phases.items():
        assert phase["interactive_errors"] == phase["batch_errors"] == 0, phase["first_error"]
        # The machine's, per phase: a share of all cores' time, and one per core.
        assert 0.0 <= phase["cpu_steal_pct"] <= 100.0, name
        assert phase["cpu_steal_pct_cores"], name
        assert all(0.0 <= v <= 100.0 for v in phase["cpu_steal_pct_cores"]), name
    assert phases["mixed"]["interactive_requests"] > 0 and phases["mixed"]["batch_requests"] > 0
    assert set(result["summary"]["edf"]) == {"ttft_p99_mixed_over_alone", "batch_throughput_kept"}
    assert len(result["rounds"]) == 1


def test_the_rounds_rotate_the_order_of_the_phases() -> None:
    orders = [round_order(i) for i in range(3)]
    assert orders[0] == ["interactive_only", "batch_only", "mixed"]
    # Over three rounds each phase runs once in each position.
    for position in range(3):
        assert {order[position] for order in orders} == set(PHASES)
    assert round_order(3) == orders[0]


async def test_rounds_pool_their_samples_and_report_each_rounds_ratios(
    gateway: Gateway,
) -> None:
    result = await bench_mixed(_args(gateway, "--duration", "0.4", "--rounds", "2"))
    pooled = result["results"]["edf"]
    rounds = [r["edf"] for r in result["rounds"]]
    assert len(rounds) == 2
    for phase in PHASES:
        for key in ("interactive_requests", "batch_requests"):
            assert pooled[phase][key] == sum(r[phase][key] for r in rounds), (phase, key)
        assert pooled[phase]["wall_s"] == pytest.approx(
            sum(r[phase]["wall_s"] for r in rounds), abs=0.11
        )
    # The second round ran the phases in the rotated order.
    assert [rounds[1][p]["position"] for p in round_order(1)] == [0, 1, 2]
    summary = result["summary"]["edf"]
    assert len(summary["rounds"]) == 2
    assert all(set(r) == {"ttft_p99_mixed_over_alone", "batch_throughput_kept"}
               for r in summary["rounds"])  # fmt: skip


async def test_with_a_step_log_the_chats_of_each_phase_report_the_step_in_flight(
    gateway: Gateway, tmp_path: Path
) -> None:
    # The test gateway's engine logs no steps: write a log over the next minute, steps
    # 10 ms apart, every other one carrying prompt tokens.
    now = time.perf_counter()
    (tmp_path / "steps-1.tsv").write_text(
        "".join(line(Step(now + i * 0.01, 8 if i % 2 else 72, 0, 0, 8)) for i in range(6000))
    )
    result = await bench_mixed(_args(gateway, "--duration", "0.4", "--step-log", str(tmp_path)))
    phases = result["results"]["edf"]
    for name in ("interactive_only", "mixed"):
        phase = phases[name]
        assert 0.0 <= phase["step_wait_ms_p50"] <= phase["step_wait_ms_p99"] <= 10.0, name
        assert phase["steps_with_prompts_pct"] == pytest.approx(50.0, abs=2.0), name
        assert phase["prompt_step_ms"] == pytest.approx(10.0, abs=0.1), name
    # A phase without chats has no request to place among the steps.
    assert "step_wait_ms_p50" not in phases["batch_only"]
