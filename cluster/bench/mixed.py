"""``charserve bench-mixed``: interactive chat beside a saturating batch load.

An open-loop interactive stream (Poisson arrivals at ``--rate``, short replies) and a
closed-loop batch load (``--batch-concurrency`` requests always in flight, ``X-Priority:
batch``, long replies) run in three phases of ``--duration`` seconds each: interactive
alone, batch alone, both together. It reports interactive TTFT p50/p99 and batch output
tokens/s per phase, and the CPU steal over each phase (:mod:`cluster.bench.steal`): the
share of the cores' time the hypervisor took, which a latency figure would otherwise read
as the server's stall.

With ``--rounds N`` the three phases run N times, each round's order rotated by one, and
each phase is reported over its N runs with their samples pooled (a p99 of 60 requests is
the slowest one; of 180, the second slowest), beside each round's own ratios. The machine
drifts by a third within minutes, so phases run minutes apart are compared on unlike
machines; rotating the order spreads that drift over all three.

With ``--step-log DIR`` (the directory the engine under test writes its step log into:
``CHARSERVE_STEP_LOG=DIR charserve up``) each phase also reports what its chats found the
engine doing when they were sent (:func:`cluster.bench.steps.step_in_flight`): how long
until the next step, the first a chat could be in, and how often the step in flight
carried prompt tokens, which make it longer.

Give it two gateways in front of the same Redis and workers, one with
``CHARSERVE_QUEUE_POLICY=edf`` and one with ``fifo``, and the two policies are measured in
one run, phase by phase, side by side. Interactive requests carry a generous latency budget
(``--interactive-budget-ms``) so that both policies serve them all and the comparison is
of scheduling alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from cluster.bench.load import USER_PROMPTS, one_request, poisson_stream
from cluster.bench.samples import Sample, percentile
from cluster.bench.steal import CpuTimes, StealTotals, read_cpu_times, steal_fields
from cluster.bench.steps import step_in_flight
from cluster.runtime.steplog import Step, read_steps


@dataclass(slots=True)
class PhaseRun:
    """One phase's run against one target: its samples, wall time and CPU readings, and
    the engine's steps over it (with ``--step-log``)."""

    interactive: list[Sample]
    batch: list[Sample]
    wall_s: float
    before: CpuTimes
    after: CpuTimes
    steps: list[Step]


async def _phase(
    url: str, args: argparse.Namespace, interactive: bool, batch: bool, seed: int
) -> PhaseRun:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    inter_headers = {
        "X-Priority": "interactive",
        "X-Latency-Budget-Ms": str(args.interactive_budget_ms),
    }
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        counters = read_cpu_times()
        start = time.perf_counter()
        stop_at = start + args.duration
        batch_samples: list[Sample] = []
        inter_samples: list[Sample] = []

        async def batch_worker() -> None:
            while time.perf_counter() < stop_at:
                batch_samples.append(
                    await one_request(
                        client,
                        url,
                        args.model,
                        args.batch_max_tokens,
                        rng.choice(USER_PROMPTS),
                        {"X-Priority": "batch"},
                    )
                )

        async def interactive_stream() -> None:
            stop = asyncio.Event()
            asyncio.get_running_loop().call_later(args.duration, stop.set)
            inter_samples.extend(
                await poisson_stream(
                    client,
                    url,
                    args.model,
                    args.interactive_max_tokens,
                    args.rate,
                    rng,
                    inter_headers,
                    stop,
                )
            )

        jobs = []
        if batch:
            jobs += [batch_worker() for _ in range(args.batch_concurrency)]
        if interactive:
            jobs.append(interactive_stream())
        await asyncio.gather(*jobs)
        end = time.perf_counter()
        after = read_cpu_times()
        # The step log's clock is the monotonic one, as perf_counter's.
        steps = read_steps(Path(args.step_log), start, end) if args.step_log else []
        return PhaseRun(inter_samples, batch_samples, end - start, counters, after, steps)


def phase_report(runs: list[PhaseRun]) -> dict[str, Any]:
    """One phase's figures over its runs (one per round), their samples pooled: TTFT
    percentiles of every interactive request, batch tokens over the runs' summed wall
    time, the CPU steal over the runs' spans, and with step logs what the chats found the
    engine doing (:func:`~cluster.bench.steps.step_in_flight`)."""
    inter = [s for run in runs for s in run.interactive]
    batch = [s for run in runs for s in run.batch]
    ok_inter = [s for s in inter if s.ok]
    ok_batch = [s for s in batch if s.ok]
    wall = sum(run.wall_s for run in runs)
    steal = StealTotals()
    for run in runs:
        steal.add(run.before, run.after)
    return {
        "interactive_requests": len(inter),
        "interactive_errors": len(inter) - len(ok_inter),
        "interactive_ttft_p50_ms": round(percentile([s.ttft_s for s in ok_inter], 50) * 1e3, 1),
        "interactive_ttft_p99_ms": round(percentile([s.ttft_s for s in ok_inter], 99) * 1e3, 1),
        "batch_requests": len(batch),
        "batch_errors": len(batch) - len(ok_batch),
        "batch_tokens_per_s": round(sum(s.output_tokens for s in ok_batch) / wall, 1),
        "wall_s": round(wall, 1),
        # Percent of all cores' time (and of each core's) the hypervisor took.
        **steal_fields(steal.percent()),
        "first_error": next((s.error for s in inter + batch if not s.ok), ""),
        **step_in_flight([(run.steps, [s.start_s for s in run.interactive]) for run in runs]),
    }


def ratios(phases: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The bounds' two ratios for one target's phases: interactive TTFT p99 beside batch
    over alone, and the share of batch throughput kept beside the chats."""
    alone, mixed, batch = phases["interactive_only"], phases["mixed"], phases["batch_only"]
    return {
        "ttft_p99_mixed_over_alone": round(
            mixed["interactive_ttft_p99_ms"] / alone["interactive_ttft_p99_ms"], 2
        ),
        "batch_throughput_kept": round(
            mixed["batch_tokens_per_s"] / batch["batch_tokens_per_s"], 2
        ),
    }


PHASES = {"interactive_only": (True, False), "batch_only": (False, True), "mixed": (True, True)}


def round_order(index: int) -> list[str]:
    """The phases in the order round ``index`` runs them: rotated by one each round, so
    over three rounds each phase runs once first, once second and once last, and a machine
    that drifts over minutes weighs on every phase alike."""
    names = list(PHASES)
    shift = index % len(names)
    return names[shift:] + names[:shift]


async def bench_mixed(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``--rounds`` rounds of the three phases for each target, interleaved phase by
    phase; report each phase over all rounds (samples pooled) and each round's ratios."""
    targets = dict(zip(args.labels.split(","), [args.base_url, *args.compare], strict=False))
    runs: dict[str, dict[str, list[PhaseRun]]] = {
        label: {phase: [] for phase in PHASES} for label in targets
    }
    per_round: list[dict[str, dict[str, Any]]] = []
    for index in range(args.rounds):
        this_round: dict[str, dict[str, Any]] = {label: {} for label in targets}
        for position, phase in enumerate(round_order(index)):
            inter, batch = PHASES[phase]
            seed = index * len(PHASES) + list(PHASES).index(phase)
            for label, url in targets.items():
                run = await _phase(url, args, inter, batch, seed)
                runs[label][phase].append(run)
                this_round[label][phase] = phase_report([run]) | {"position": position}
        per_round.append(this_round)
    results = {
        label: {phase: phase_report(phase_runs) for phase, phase_runs in by_phase.items()}
        for label, by_phase in runs.items()
    }
    summary: dict[str, Any] = {}
    for label, phases in results.items():
        summary[label] = ratios(phases)
        if args.rounds > 1:
            summary[label]["rounds"] = [ratios(r[label]) for r in per_round]
    labels = list(targets)
    if len(labels) == 2:
        a, b = (results[x]["mixed"]["interactive_ttft_p99_ms"] for x in labels)
        summary[f"mixed_ttft_p99_{labels[1]}_over_{labels[0]}"] = round(b / a, 2)
    return {
        "workload": vars(args) | {"compare": args.compare},
        "results": results,
        "rounds": per_round,
        "summary": summary,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``charserve bench-mixed``."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--compare", action="append", default=[], help="second gateway URL")
    parser.add_argument("--labels", default="edf,fifo", help="names of the targets, in order")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rate", type=float, default=1.0, help="interactive requests/s")
    parser.add_argument("--interactive-max-tokens", type=int, default=16)
    parser.add_argument("--interactive-budget-ms", type=int, default=600_000)
    parser.add_argument("--batch-concurrency", type=int, default=48)
    parser.add_argument("--batch-max-tokens", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per phase")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of the three phases, each round's order rotated; samples are pooled",
    )
    parser.add_argument(
        "--step-log",
        default=None,
        metavar="DIR",
        help="the engine's step log directory (CHARSERVE_STEP_LOG=DIR charserve up): "
        "report what each phase's chats found the engine doing",
    )
    parser.add_argument("--output", default=None, help="write the JSON result here")


def run(args: argparse.Namespace) -> int:
    """Run ``charserve bench-mixed`` and print a table."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.step_log and not Path(args.step_log).is_dir():
        print(f"--step-log: {args.step_log} is not a directory", file=sys.stderr)
        return 2
    result = asyncio.run(bench_mixed(args))
    rows = [
        ("interactive_only", "interactive_ttft_p50_ms"),
        ("interactive_only", "interactive_ttft_p99_ms"),
        ("mixed", "interactive_ttft_p50_ms"),
        ("mixed", "interactive_ttft_p99_ms"),
        ("batch_only", "batch_tokens_per_s"),
        ("mixed", "batch_tokens_per_s"),
        ("mixed", "interactive_errors"),
        ("mixed", "batch_errors"),
        ("interactive_only", "cpu_steal_pct"),
        ("batch_only", "cpu_steal_pct"),
        ("mixed", "cpu_steal_pct"),
    ]
    if args.step_log:
        rows += [
            (phase, metric)
            for phase in ("interactive_only", "mixed")
            for metric in ("step_wait_ms_p50", "step_wait_ms_p99", "in_flight_with_prompts_pct")
        ] + [("mixed", "prompt_step_ms"), ("mixed", "decode_only_step_ms")]
    labels = list(result["results"])
    print(f"{'phase / metric':<44}" + "".join(f"{label:>14}" for label in labels))
    for phase, metric in rows:
        cells = "".join(
            f"{result['results'][label][phase].get(metric, '-'):>14}" for label in labels
        )
        print(f"{phase + ' ' + metric:<44}{cells}")
    for key, value in result["summary"].items():
        print(f"{key}: {value}")
    if args.step_log and not any(
        "step_wait_ms_p50" in phases["mixed"] for phases in result["results"].values()
    ):
        print(
            f"no engine steps in {args.step_log} over the phases: does the engine under "
            "test log its steps there (CHARSERVE_STEP_LOG)?",
            file=sys.stderr,
        )
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))
    return 0
