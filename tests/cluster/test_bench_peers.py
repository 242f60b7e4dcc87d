"""``charserve bench-peers``'s table: medians over rounds, ratios to vLLM by one client."""

from __future__ import annotations

from cluster.bench.peers import table


def _row(
    r: int, peer: str, client: str, c: int, tok_s: float, ttft: float
) -> dict[str, float | int | str]:
    return {
        "round": r, "peer": peer, "client": client, "c": c, "ttft_p50": ttft, "ttft_p99": ttft,
        "itl_p50": 10.0, "itl_p99": 20.0, "tok_s": tok_s, "failed": 0,
    }  # fmt: skip


def test_ratios_are_to_vllm_by_the_same_client_and_median_over_rounds() -> None:
    rows = [
        _row(1, "vllm", "vllm", 32, 300, 100),
        _row(2, "vllm", "vllm", 32, 320, 120),
        _row(3, "vllm", "vllm", 32, 310, 110),
        _row(1, "charserve", "vllm", 32, 310, 100),
        _row(2, "charserve", "vllm", 32, 341, 55),
        _row(3, "charserve", "vllm", 32, 1000, 99),
        _row(1, "charserve", "charserve", 32, 1.0, 1.0),  # no vLLM row for this client
    ]
    text, summary = table(rows)
    ours = summary["vllm/charserve/c32"]
    assert ours["tok_s"] == 341 and ours["tok_s_over_vllm"] == round(341 / 310, 3)
    assert ours["ttft_p50_over_vllm"] == round(99 / 110, 3)
    assert "tok_s_over_vllm" not in summary["charserve/charserve/c32"]
    assert "tok_s_over_vllm" not in summary["vllm/vllm/c32"]
    assert "(1.10x)" in text
