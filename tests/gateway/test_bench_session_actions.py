"""``charserve bench-sessions --actions`` runs end to end against a gateway with a fake
engine (the figures are the real stack's to give; this checks the client's path)."""

from __future__ import annotations

import argparse

from cluster.bench import session_actions
from tests.gateway.conftest import Gateway


async def test_the_actions_bench_runs_every_comparison(gateway: Gateway) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    session_actions.add_arguments(parser)
    args = parser.parse_args(["--actions", "--warm-history-turns", "2", "--warm-pause-s", "0"])
    args.url, args.sessions, args.turns, args.max_tokens = gateway.base_url, 2, 3, 4
    args.priority = "standard"
    report = await session_actions.bench(args)
    assert report["swipe"]["swipe"]["n"] == 2 and report["swipe"]["swipe"]["errors"] == 0
    assert report["warm"]["warmed"]["n"] == 2 and report["warm"]["not_warmed"]["n"] == 2
    assert list(report["layout"]) == ["stable"]
    assert len(report["layout"]["stable"]["cached_share_by_turn"]) == 3
    assert "swipe TTFT p50" in session_actions.table(report)
