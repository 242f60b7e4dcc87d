"""``charserve bench-mixed`` against a real gateway: every phase runs and reports."""

from __future__ import annotations

import argparse

from cluster.bench.mixed import add_arguments, bench_mixed
from tests.gateway.conftest import Gateway


async def test_every_phase_serves_both_classes_and_reports_its_cpu_steal(
    gateway: Gateway,
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--base-url", gateway.base_url, "--labels", "edf", "--duration", "0.6",
         "--rate", "10", "--batch-concurrency", "2", "--batch-max-tokens", "4",
         "--interactive-max-tokens", "2"]
    )  # fmt: skip
    result = await bench_mixed(args)
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
