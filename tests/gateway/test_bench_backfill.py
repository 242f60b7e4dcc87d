"""``charserve bench-backfill``'s served phases against a real gateway: every phase runs
and reports its CPU steal."""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster.bench.backfill import add_arguments, served_phase, write_dialogues
from tests.gateway.conftest import Gateway


async def test_the_served_phases_run_and_each_reports_its_cpu_steal(
    gateway: Gateway, tmp_path: Path
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--dialogues", "2", "--turns", "1", "--max-tokens", "4", "--user-max-tokens", "3",
         "--concurrency", "2", "--rate", "10", "--interactive-max-tokens", "2",
         "--baseline-s", "0.5"]
    )  # fmt: skip
    source, beside = tmp_path / "dialogues.jsonl", tmp_path / "beside.jsonl"
    write_dialogues(source, 2, 1, seed=0)
    write_dialogues(beside, 2, 1, seed=1, prefix="beside")
    served = await served_phase(gateway.base_url, args, source, beside, tmp_path)
    assert served["backfill"]["dialogues"] == served["backfill_with_interactive"]["dialogues"] == 2
    assert served["interactive_alone"]["requests"] > 0
    assert served["interactive_alone"]["errors"] == 0
    assert served["interactive_with_backfill"]["errors"] == 0
    for name, phase in served.items():
        # The machine's, per phase: a share of all cores' time, and one per core.
        assert 0.0 <= phase["cpu_steal_pct"] <= 100.0, name
        assert phase["cpu_steal_pct_cores"], name
    # The chats beside the backfill ran over the same span as it.
    assert (
        served["interactive_with_backfill"]["cpu_steal_pct"]
        == served["backfill_with_interactive"]["cpu_steal_pct"]
    )
