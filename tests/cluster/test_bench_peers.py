"""``charserve bench-peers``: the table (medians over rounds, ratios to vLLM by one client),
the running-sequences sampling, and reading vLLM's client on the persona workload."""

from __future__ import annotations

import argparse
import http.server
import json
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cluster.bench import peers as bench_peers
from cluster.bench.peers import (
    MIN_CLEAN_GAPS,
    RunningSampler,
    _freeze,
    _our_client,
    _thaw,
    add_arguments,
    check,
    clean_itl,
    parse_running,
    peers,
    prefix_order,
    read_detailed,
    read_vllm,
    round_order,
    running_mean,
    signal_tree,
    table,
    tree_pids,
)
from cluster.bench.steal import window_steal
from cluster.runtime.steplog import STEP_LOG_ENV


def _row(
    r: int, peer: str, client: str, c: int, tok_s: float, ttft: float, running: float = 8.0
) -> dict[str, Any]:
    return {
        "round": r, "peer": peer, "client": client, "c": c, "ttft_p50": ttft, "ttft_p99": ttft,
        "itl_p50": 10.0, "itl_p99": 20.0, "tok_s": tok_s, "failed": 0, "running_mean": running,
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


def test_each_round_reports_its_own_ratios_beside_the_ratio_of_medians() -> None:
    rows = [
        _row(1, "vllm", "vllm", 32, 300, 100),
        _row(1, "charserve", "vllm", 32, 240, 110),
        _row(2, "charserve", "vllm", 32, 330, 90),
        _row(2, "vllm", "vllm", 32, 300, 100),
        _row(3, "charserve", "vllm", 32, 999, 999),  # vLLM's run of round 3 failed
    ]
    text, summary = table(rows)
    ours = summary["vllm/charserve/c32"]
    assert ours["tok_s_over_vllm_by_round"] == [0.8, 1.1]
    assert ours["ttft_p50_over_vllm_by_round"] == [1.1, 0.9]
    assert ours["tok_s_over_vllm"] == 1.1  # the median of three rounds, 330, over 300
    assert "vllm/vllm/c32" in summary
    assert "tok_s_over_vllm_by_round" not in summary["vllm/vllm/c32"]
    assert "each round's own ratios" in text
    assert "tok_s 0.80/1.10" in text


def test_one_round_prints_no_spread() -> None:
    rows = [_row(1, "vllm", "vllm", 1, 80, 50), _row(1, "charserve", "vllm", 1, 84, 55)]
    text, summary = table(rows)
    assert summary["vllm/charserve/c1"]["tok_s_over_vllm_by_round"] == [1.05]
    assert "each round's own ratios" not in text


def test_even_rounds_run_the_peers_in_reverse_order() -> None:
    assert round_order(["vllm", "charserve"], 1) == ["vllm", "charserve"]
    assert round_order(["vllm", "charserve"], 2) == ["charserve", "vllm"]
    assert round_order(["vllm", "vllm-ours", "charserve"], 4) == ["charserve", "vllm-ours", "vllm"]


def test_running_mean_is_a_column_with_its_ratio_and_a_missing_figure_is_skipped() -> None:
    rows = [
        _row(1, "vllm", "vllm", 8, 100, 100, running=8.0),
        _row(2, "vllm", "vllm", 8, 100, 100, running=6.0),
        _row(1, "charserve", "vllm", 8, 100, 100, running=3.5),
        _row(2, "charserve", "vllm", 8, 100, 100, running=math.nan),  # nothing sampled
    ]
    text, summary = table(rows)
    assert "running_mean" in text.splitlines()[0]
    assert summary["vllm/charserve/c8"]["running_mean"] == 3.5
    assert summary["vllm/charserve/c8"]["running_mean_over_vllm"] == 0.5
    assert "(0.50x)" in text


def test_cpu_steal_is_shown_beside_the_figures_per_round_and_never_as_a_ratio() -> None:
    rows = [
        {**_row(1, "vllm", "vllm", 1, 80, 50), "steal_pct": 1.0},
        {**_row(1, "charserve", "vllm", 1, 80, 50), "steal_pct": 12.5},
        {**_row(2, "charserve", "vllm", 1, 80, 50), "steal_pct": 2.5},
        {**_row(2, "vllm", "vllm", 1, 80, 50), "steal_pct": 3.0},
        _row(1, "charserve", "charserve", 1, 80, 50),  # no counters (not Linux)
    ]
    text, summary = table(rows)
    lines = text.splitlines()
    assert "steal%" in lines[0].split()
    assert summary["vllm/charserve/c1"]["steal_pct"] == 7.5  # the median of the rounds
    assert "steal_pct_over_vllm" not in summary["vllm/charserve/c1"]
    stolen = lines[lines.index("CPU steal in each round, percent of all cores' time:") + 1 :]
    assert [line.split() for line in stolen] == [
        ["vllm", "1", "charserve", "12.5/2.5"],
        ["vllm", "1", "vllm", "1.0/3.0"],
    ]
    ours = next(line for line in lines[1:] if line.startswith("charserve "))
    assert ours.split()[-2] == "-"


def test_refusals_and_failures_are_totals_over_the_rounds_not_medians() -> None:
    rows = [
        {**_row(1, "charserve", "vllm", 32, 200, 900), "refused": 0},
        {**_row(2, "charserve", "vllm", 32, 150, 900), "refused": 68, "failed": 68},
        {**_row(3, "charserve", "vllm", 32, 210, 900), "refused": 0},
        {**_row(1, "vllm", "vllm", 32, 200, 900)},  # vLLM's client omits a zero count
    ]
    text, summary = table(rows)
    assert summary["vllm/charserve/c32"]["refused"] == 68
    ours = next(line for line in text.splitlines() if line.startswith("vllm       32 charserve"))
    assert ours.split()[-4:-2] == ["68", "68"]
    assert summary["vllm/charserve/c32"]["failed"] == 68
    assert math.isnan(summary["vllm/vllm/c32"]["refused"])
    assert summary["vllm/vllm/c32"]["failed"] == 0


def test_the_persona_table_has_ttft_of_later_turns_and_refusals() -> None:
    rows = [
        {**_row(1, "vllm", "charserve", 8, 100, 400), "ttft_later_p50": 200.0, "refused": 0},
        {**_row(1, "charserve", "charserve", 8, 90, 500), "ttft_later_p50": 150.0, "refused": 3},
        # vLLM's client reports no refusals when nothing failed: the count is absent.
        {**_row(1, "vllm", "vllm", 8, 100, 400), "ttft_later_p50": 210.0},
    ]
    text, summary = table(rows, "persona")
    header = text.splitlines()[0].split()
    assert header[3:5] == ["ttft_p50", "ttft_later_p50"] and "refused" in header
    ours = summary["charserve/charserve/c8"]
    assert ours["ttft_later_p50_over_vllm"] == 0.75 and ours["refused"] == 3
    assert math.isnan(summary["vllm/vllm/c8"]["refused"])
    assert "ttft_later_p50" not in table(rows)[0]  # chat leaves it out


VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 5.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
vllm:num_requests_waiting{engine="0",model_name="m"} 9.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
vllm:prompt_tokens_total{engine="0",model_name="m"} 1200.0
vllm:generation_tokens_total{engine="0",model_name="m"} 3.4e+02
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e9
charserve_worker_inflight{replica="w1"} 7.0
"""


def test_parse_running_sums_the_gauge_over_engines_and_reads_progress() -> None:
    assert parse_running(VLLM_PAGE) == (7.0, 1540.0)
    assert parse_running("") == (0.0, 0.0)


def test_a_live_gauge_is_averaged_over_the_window() -> None:
    samples = [(t / 10, float(t), 0.0) for t in range(100)]  # running = 10 x time
    mean, points = running_mean(samples, 2.0, 4.0, 0.1, 0.0)
    assert points == 21 and mean == pytest.approx(30.0)


def test_a_republished_gauge_counts_each_export_in_the_window_once() -> None:
    # Polled every 0.5 s; exports at 1, 6, 11 and 16 s (the marker changes), each holding
    # the engine's value at that moment. The run is 3..14 s: the exports at 6 and 11 s.
    held = {1: (4.0, 100.0), 6: (8.0, 200.0), 11: (6.0, 300.0), 16: (0.0, 400.0)}
    samples = []
    value = (0.0, 0.0)
    for i in range(40):
        t = i * 0.5
        value = held.get(int(t), value) if t == int(t) else value
        samples.append((t, *value))
    mean, points = running_mean(samples, 3.0, 14.0, 0.5, 5.0)
    assert (mean, points) == (7.0, 2)
    assert math.isnan(running_mean(samples, 30.0, 40.0, 0.5, 5.0)[0])


def _detailed(tmp_path: Path, seed: int) -> Path:
    """A ``vllm bench serve --save-detailed`` result: 8 requests, 2 prefixes."""
    prefixes = prefix_order(8, 2, seed)
    starts, ttfts = [], []
    for i, p in enumerate(prefixes):
        first = prefixes.index(p) == i
        # The first of each prefix starts at 0 and ends at 1 s; the others start later.
        starts.append(0.0 if first else 1.0 + i)
        ttfts.append(0.5 if first else 0.1)
    d = {
        "completed": 7, "num_prompts": 8, "median_ttft_ms": 100.0, "p99_ttft_ms": 500.0,
        "median_itl_ms": 10.0, "p99_itl_ms": 20.0, "output_throughput": 50.0,
        "start_times": starts, "ttfts": ttfts, "latencies": [1.0] * 8,
        "errors": [""] * 7 + ["Too Many Requests"],
        "dataset": "prefix_repetition", "num_prefixes": "2", "seed": str(seed),
    }  # fmt: skip
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps(d))
    return path


def test_read_vllm_takes_later_ttft_refusals_and_window_from_the_detailed_result(
    tmp_path: Path,
) -> None:
    figures = read_vllm(_detailed(tmp_path, seed=8))
    assert figures["ttft_later_p50"] == pytest.approx(100.0)  # the firsts' 500 ms left out
    assert figures["refused"] == 1 and figures["failed"] == 1
    assert figures["start_s"] == 0.0 and figures["end_s"] > 1.0


def test_prefix_order_is_the_order_vllm_sends_its_prefix_repetition_requests(
    model_path: str,
) -> None:
    from transformers import AutoTokenizer

    # vLLM's own dataset (absent from the gateway-only install).
    datasets = pytest.importorskip("vllm.benchmarks.datasets.datasets")
    PrefixRepetitionRandomDataset = datasets.PrefixRepetitionRandomDataset

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    for seed in (1, 8):
        requests = PrefixRepetitionRandomDataset(random_seed=seed).sample(
            tokenizer, num_requests=12, prefix_len=64, suffix_len=16, num_prefixes=3
        )
        expected = prefix_order(12, 3, seed)
        # Same prefix, same opening text; different prefixes differ.
        heads = [r.prompt[:80] for r in requests]
        for i in range(12):
            for j in range(12):
                assert (heads[i] == heads[j]) == (expected[i] == expected[j])


def test_persona_options_are_checked_before_any_server_starts() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    check(parser.parse_args(["--workload", "persona", "--concurrency", "8", "--prompts", "64"]))
    for bad in (
        ["--concurrency", "8", "--prompts", "60"],  # not whole conversations
        ["--concurrency", "8", "--prompts", "8"],  # one turn: no later turns
        ["--concurrency", "4", "--prompts", "12", "--personas", "8"],  # vLLM's prefixes
        ["--clients", "vllm", "guidellm"],
        ["--our-client", "httpx"],  # conversations have one client
    ):
        with pytest.raises(SystemExit):
            check(parser.parse_args(["--workload", "persona", *bad]))


def test_a_charserve_config_is_a_peer_of_its_own_serving_that_config(tmp_path: Path) -> None:
    config = tmp_path / "spin.yaml"
    config.write_text("applications: []\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--charserve-config", f"spin={config}"]
    argv += ["--peers", "vllm", "charserve", "charserve-spin"]
    args = parser.parse_args(["--out", str(tmp_path / "out"), *argv])
    check(args)
    known = peers(args, "/model")
    spin, default = known["charserve-spin"], known["charserve"]
    assert spin.command == default.command  # charserve up, the same way
    assert spin.env["CHARSERVE_SERVE_CONFIG"] == str(config.resolve())
    assert "CHARSERVE_SERVE_CONFIG" not in default.env  # the default config, as make run
    # Each keeps its own data (its Redis, its queues) apart from the other's.
    assert spin.env["CHARSERVE_DATA_DIR"] != default.env["CHARSERVE_DATA_DIR"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--peers", "charserve-spin"],  # no such config given
        ["--peers", "vllm", "vllm"],
        ["--charserve-config", "spin", "--peers", "vllm"],  # no path
        ["--charserve-config", "Spin Fast=x.yaml", "--peers", "vllm"],
        ["--charserve-config", "spin=/nonexistent.yaml", "--peers", "vllm"],
        ["--charserve-config", "a=CFG", "--charserve-config", "a=CFG", "--peers", "vllm"],
        # Together: each charserve up serves port 8000 with a Ray of its own.
        ["--together", "--charserve-config", "b=CFG", "--peers", "charserve", "charserve-b"],
        ["--together", "--pause-s", "-1"],
    ],
)
def test_unknown_peers_and_malformed_configs_are_refused_before_any_server_starts(
    argv: list[str], tmp_path: Path
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("applications: []\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        check(parser.parse_args([a.replace("CFG", str(config)) for a in argv]))


def test_a_long_peer_name_widens_its_column() -> None:
    rows = [_row(1, "vllm", "vllm", 1, 50.0, 60.0)]
    rows.append(_row(1, "charserve-spin", "vllm", 1, 50.0, 66.0))
    text, summary = table(rows)
    header, *body = text.splitlines()
    assert "vllm/charserve-spin/c1" in summary
    # The first figure's cell ends where its header does, with or without a ratio.
    ends = {header.index("ttft_p50") + len("ttft_p50")}
    for line in body:
        cell = "60.0" if "60.0" in line else "66.0 (1.10x)"
        ends.add(line.index(cell) + len(cell))
    assert len(ends) == 1


def test_the_sampler_reads_the_cpu_counters_from_its_start_to_its_stop() -> None:
    # No server answers: the gauge has no samples, the counters are still read.
    sampler = RunningSampler("http://127.0.0.1:9/metrics", poll_s=0.05)
    with sampler.running():
        started_s = time.monotonic()
        time.sleep(0.2)
        ended_s = time.monotonic()
    times = [t for t, _ in sampler.cpu]
    assert sampler.samples == []
    assert times[0] <= started_s and times[-1] >= ended_s and len(times) >= 3
    if Path("/proc/stat").exists():
        assert "cpu" in window_steal(sampler.cpu, started_s, ended_s)


def test_a_sampler_without_a_page_reads_only_the_cpu_counters() -> None:
    sampler = RunningSampler(None, poll_s=0.05)
    with sampler.running():
        time.sleep(0.2)
    assert sampler.samples == [] and len(sampler.cpu) >= 3


def test_our_client_is_the_lean_one_unless_asked_for_httpx(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    peer = peers(parser.parse_args([]), "/model")["charserve"]

    def client_of(argv: list[str]) -> str:
        cmd = _our_client(peer, 32, 128, parser.parse_args(argv), tmp_path / "r.json")
        return cmd[cmd.index("--client") + 1]

    assert client_of([]) == "lean"
    assert client_of(["--our-client", "httpx"]) == "httpx"


def _argv_after(cmd: list[str], module: str) -> list[str]:
    return cmd[cmd.index(module) + 1 :]


def _priority_args(priority: str | None, *more: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([*more, *([] if priority is None else ["--priority", priority])])
    check(args)
    return args


def test_a_priority_reaches_vllms_client_as_its_parser_reads_it(tmp_path: Path) -> None:
    serve = pytest.importorskip("vllm.benchmarks.serve")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for priority in (None, "standard"):
        args = _priority_args(priority)
        peer = peers(args, "/model")["charserve"]
        vllm_parser = FlexibleArgumentParser()
        serve.add_cli_args(vllm_parser)
        cmd = bench_peers._vllm_client(peer, "/model", 32, 128, args, tmp_path / "r.json")
        parsed = vllm_parser.parse_args(_argv_after(cmd, "workers.baselines.vllm_bench"))
        assert parsed.header == ([f"X-Priority={priority}"] if priority else None)


def test_a_priority_reaches_our_clients_as_their_parsers_read_it(tmp_path: Path) -> None:
    from cluster.bench import conversations, load

    out = tmp_path / "r.json"
    for priority in (None, "standard"):
        args = _priority_args(priority)
        peer = peers(args, "/model")["charserve"]
        ours = argparse.ArgumentParser()
        load.add_arguments(ours)
        cmd = _our_client(peer, 32, 128, args, out)
        asked = {"X-Priority": priority} if priority else {}
        assert load.parse_headers(ours.parse_args(_argv_after(cmd, "bench")).header) == asked
        talk = argparse.ArgumentParser()
        conversations.add_arguments(talk)
        persona = _priority_args(priority, "--workload", "persona")
        cmd = _our_client(peer, 8, 64, persona, out)
        parsed = talk.parse_args(_argv_after(cmd, "cluster.bench.conversations"))
        assert load.parse_headers(parsed.header) == asked
    with pytest.raises(SystemExit, match="--priority"):
        _priority_args("standard", "--clients", "vllm", "guidellm")


def test_the_counters_are_read_every_half_second_when_the_page_is_polled_less_often() -> None:
    sampler = RunningSampler("http://127.0.0.1:9/metrics", poll_s=2.0)
    with sampler.running():
        time.sleep(1.3)
    # Its start, two reads in between, its stop; the page would be polled first at 2 s.
    assert len(sampler.cpu) >= 4
    gaps = [b - a for (a, _), (b, _) in zip(sampler.cpu, sampler.cpu[1:-1], strict=False)]
    assert all(gap < 1.0 for gap in gaps)


def test_the_page_is_never_polled_more_often_than_poll_s() -> None:
    gets: list[float] = []

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            gets.append(time.monotonic())
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        # 0.7 s is not a multiple of the counters' 0.5 s: reads every 0.35 s, page every 0.7.
        sampler = RunningSampler(f"http://127.0.0.1:{server.server_port}/metrics", poll_s=0.7)
        with sampler.running():
            time.sleep(1.6)
    finally:
        server.shutdown()
        server.server_close()
    assert 1 <= len(gets) <= 2
    assert len(sampler.cpu) >= len(gets) + 2


def test_the_clean_itl_is_a_section_with_ratios_and_rounds_without_enough_gaps_left_out() -> None:
    def clean(row: dict[str, Any], p50: float, p99: float, share: float) -> dict[str, Any]:
        return {**row, "itl_p50_clean": p50, "itl_p99_clean": p99, "clean_gaps_pct": share}

    rows = [
        clean(_row(1, "vllm", "vllm", 32, 300, 100), 40.0, 200.0, 80.0),
        clean(_row(2, "vllm", "vllm", 32, 300, 100), 42.0, 220.0, 60.0),
        clean(_row(1, "charserve", "vllm", 32, 300, 100), 41.0, 231.0, 50.0),
        # Too few clean gaps for figures: only its share counts.
        clean(_row(2, "charserve", "vllm", 32, 300, 100), math.nan, math.nan, 4.0),
        _row(1, "charserve", "charserve", 32, 300, 100),  # a client that keeps no gaps
    ]
    text, summary = table(rows)
    ours = summary["vllm/charserve/c32"]
    assert ours["itl_p99_clean"] == 231.0 and ours["itl_p99_clean_over_vllm"] == 1.1
    assert ours["clean_gaps_pct"] == 27.0
    assert "itl_p99_clean_over_vllm" not in summary["vllm/vllm/c32"]
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("ITL p50, p99 (ms)"))
    assert [line.split()[:3] for line in lines[head + 1 :]] == [
        ["vllm", "32", "charserve"],
        ["vllm", "32", "vllm"],
    ]
    assert "(1.10x)" in lines[head + 1] and lines[head + 1].endswith("1 rounds")
    # The main table's columns are unchanged.
    assert "itl_p99_clean" not in lines[0]


def test_clean_itl_needs_enough_clean_gaps_and_gives_their_share() -> None:
    readings = [(0.0, {"cpu0": (0, 0)}), (100.0, {"cpu0": (10000, 0)})]

    def record(n: int) -> dict[str, list[Any]]:
        return {"start_times": [1.0], "ttfts": [0.1], "itls": [[0.01] * n], "errors": [""]}

    few = clean_itl(readings, record(MIN_CLEAN_GAPS - 1))
    assert math.isnan(few["itl_p99_clean"]) and few["clean_gaps_pct"] == 100.0
    enough = clean_itl(readings, record(MIN_CLEAN_GAPS))
    assert enough["itl_p50_clean"] == pytest.approx(10.0)
    assert enough["itl_p99_clean"] == pytest.approx(10.0)
    assert clean_itl(readings, None) == {}


def test_both_clients_records_are_read_and_ours_is_asked_for(tmp_path: Path) -> None:
    record = {"start_times": [1.0], "ttfts": [0.1], "itls": [[0.02]], "errors": [""]}
    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps({"targets": {"http://x": {"errors": 0, "detailed": record}}}))
    assert read_detailed("charserve", "chat", ours) == record
    vllm = tmp_path / "vllm.json"
    vllm.write_text(json.dumps({"completed": 1, "median_itl_ms": 20.0, **record}))
    assert read_detailed("vllm", "chat", vllm) == record
    assert read_detailed("vllm", "chat", _detailed(tmp_path, seed=1)) is None  # no gaps kept
    assert read_detailed("charserve", "persona", ours) is None  # conversations keep none
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"targets": {"http://x": {"errors": 0}}}))
    assert read_detailed("charserve", "chat", bare) is None

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    peer = peers(parser.parse_args([]), "/model")["charserve"]
    assert "--save-detailed" in _our_client(peer, 32, 128, parser.parse_args([]), ours)


def test_together_takes_any_vllm_peers_beside_one_charserve() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    check(parser.parse_args(["--together", "--peers", "vllm", "vllm-ours", "charserve"]))


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _states_within(pids: list[int], wanted: Callable[[set[str]], bool]) -> bool:
    deadline = time.monotonic() + 5
    while not wanted({_state(p) for p in pids}):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_freezing_a_peer_stops_every_process_it_started_and_thawing_resumes_them() -> None:
    # A server in a session of its own, as _start starts one: a child in its session, and
    # a child in a session of its own (as charserve up starts its gateway and Redis).
    command = "sleep 60 & setsid sleep 60 & exec sleep 60"
    process = subprocess.Popen(["sh", "-c", command], start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while len(pids := tree_pids(process.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(pids) == 3 and pids[0] == process.pid
        assert os.getpid() not in pids  # not what started the server
        # A signal takes effect when its process next leaves the kernel: not at once for
        # one running on the other core, so each state is waited for (up to 5 s).
        _freeze(process)
        assert _states_within(pids, lambda states: states == {"T"})
        _thaw(process)
        assert _states_within(pids, lambda states: "T" not in states)
    finally:
        signal_tree(process.pid, signal.SIGKILL)
        process.wait()


def test_together_measures_each_peer_while_the_others_are_frozen_and_stops_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--together", "--rounds", "2", "--pause-s", "0", "--out", str(tmp_path)]
    )
    frozen: set[str] = set()
    events: list[tuple[str, ...]] = []

    class Server:
        def __init__(self, name: str) -> None:
            self.name = name

    def start(peer: Any, log_path: Path) -> tuple[Any, Any]:
        events.append(("start", peer.name))
        return Server(peer.name), log_path.open("wb")

    def measure_peer(peer: Any, model: str, a: Any, r: int) -> list[dict[str, Any]]:
        # Only the measured peer runs; every other one is frozen.
        assert frozen == set(args.peers) - {peer.name}
        events.append(("measure", peer.name, str(r)))
        if r == 2 and peer.name == "charserve":
            raise RuntimeError("a client failed")
        return [{"round": r, "peer": peer.name}]

    monkeypatch.setattr(bench_peers, "resolve_model", lambda _: "/model")
    monkeypatch.setattr(bench_peers, "_start", start)
    monkeypatch.setattr(bench_peers, "_wait_ready", lambda *a: None)
    monkeypatch.setattr(bench_peers, "_warm", lambda peer, *a: events.append(("warm", peer.name)))
    monkeypatch.setattr(bench_peers, "_measure_peer", measure_peer)
    monkeypatch.setattr(bench_peers, "_freeze", lambda s: frozen.add(s.name))
    monkeypatch.setattr(bench_peers, "_thaw", lambda s: frozen.discard(s.name))
    monkeypatch.setattr(bench_peers, "_stop", lambda s: events.append(("stop", s.name)))
    with pytest.raises(RuntimeError):
        bench_peers.measure(args)
    assert events == [
        ("start", "vllm"), ("warm", "vllm"), ("start", "charserve"), ("warm", "charserve"),
        ("measure", "vllm", "1"), ("measure", "charserve", "1"),
        ("measure", "charserve", "2"),  # even rounds reversed; it failed
        ("stop", "vllm"), ("stop", "charserve"),  # everything stopped all the same
    ]  # fmt: skip
    assert frozen == set()  # thawed, so each could act on its SIGTERM


def test_a_step_log_is_asked_of_charserve_and_of_vllms_own_server_only_when_wanted(
    tmp_path: Path,
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    plain = peers(parser.parse_args(["--out", str(tmp_path)]), "/model")
    assert "--scheduler-cls" not in plain["vllm"].command
    assert all(STEP_LOG_ENV not in p.env for p in plain.values())
    logged = peers(parser.parse_args(["--out", str(tmp_path), "--step-log"]), "/model")
    vllm, ours = logged["vllm"], logged["charserve"]
    at = vllm.command.index("--scheduler-cls")
    assert vllm.command[at + 1] == "workers.engines.steplog.LoggingScheduler"
    # Each engine core logs into a folder of its own, under --out.
    assert vllm.env[STEP_LOG_ENV] == str((tmp_path / "vllm-steps").resolve())
    assert ours.env[STEP_LOG_ENV] == str((tmp_path / "charserve-steps").resolve())


def test_each_runs_engine_steps_are_a_section_of_the_table() -> None:
    steps = {"steps": 391, "arrival_steps": 18, "arrivals": "1×6 25×5", "stalled_pct": 1.6,
             "decode_step_ms": 117.5}  # fmt: skip
    ours = {**steps, "arrivals": "1×11 23×3"}
    rows = [
        {**_row(1, "vllm", "vllm", 32, 190.0, 2900.0), "engine_steps": steps},
        {**_row(1, "charserve", "vllm", 32, 196.0, 3200.0), "engine_steps": ours},
        _row(1, "charserve", "charserve", 32, 196.0, 3200.0),  # a run without a step log
    ]
    text, _ = table(rows)
    section = text.split("engine steps per run")[1].splitlines()[1:]
    assert len(section) == 2
    assert section[0].split()[:3] == ["vllm", "32", "charserve"]
    assert "(1×11 23×3)" in section[0] and "1.60% of decodes stalled" in section[0]
    assert section[1].split()[:3] == ["vllm", "32", "vllm"] and "(1×6 25×5)" in section[1]
