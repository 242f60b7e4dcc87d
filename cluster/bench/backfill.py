"""``charserve bench-backfill``: backfill throughput against vLLM's offline ``LLM.chat`` on
the same dialogues, and interactive time to first token while the backfill runs, in one
run with the same model and engine settings.

1. Writes ``--dialogues`` synthetic dialogues (inline cards, personas, seeds) and the
   plans the backfill resolves from them.
2. Starts ``charserve up`` with ``--config`` (a private Redis and data folder), sends an
   open-loop interactive stream (Poisson at ``--rate``/s, ``--interactive-max-tokens``)
   alone for ``--baseline-s``, then runs the backfill of those dialogues alone
   (``--concurrency`` dialogues in flight, ``X-Priority: batch``), then a second set of as
   many dialogues (other ids and seeds) with the same interactive stream beside it. Then
   stops the stack.
3. Only then (never two engines at once) runs :mod:`workers.baselines.offline_chat`: vLLM's
   offline ``LLM.chat`` with the engine settings of the same Serve config, on the same
   plans.

It reports backfill (alone) and offline completion tokens/s and their ratio, the backfill's
tokens/s beside the interactive stream too, and interactive TTFT p50/p99 alone and with the
backfill, against ``--ttft-bound-ms`` (the interactive budget) and as a ratio.
With ``--ignore-eos`` (the default) every turn is exactly its ``max_tokens`` on both sides,
so both do the same work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from cluster.backfill.driver import Options, backfill
from cluster.backfill.plan import parse_spec, plan_dialogue
from cluster.bench.load import USER_PROMPTS, one_request, poisson_stream
from cluster.bench.samples import Sample, percentile
from cluster.bench.steal import read_cpu_times, steal_since
from cluster.runtime.net import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[2]
_CHARACTERS = [
    ("Captain Mira Vance", "the sharp-tongued but kind captain of the starship Wayfarer",
     "The Wayfarer drifts near the Kessler Belt with a failing engine.",
     "Welcome aboard, {{user}}. Mind the coolant leak."),
    ("Professor Elric Thorn", "an absent-minded alchemist who teaches at the Academy of Brass",
     "A lab accident has turned the west wing into a garden of glass.",
     "Ah, {{user}}! Do not touch anything that glows."),
    ("Nyx", "a street-smart courier in a rain-soaked megacity who trusts no one",
     "A package that should not exist is ticking in Nyx's bag.",
     "You're late, {{user}}. Talk fast."),
    ("Grandmother Oak", "an ancient talking tree who guards the village well",
     "Drought has come to the valley for the first time in a century.",
     "Sit, little one. The roots tell me you have a question."),
]  # fmt: skip
_PERSONAS = [
    ("Sam", "A nervous cadet on a first voyage, eager to please."),
    ("Riley", "A sarcastic journalist chasing a story."),
    ("Ada", "A retired engineer who fixes everything and trusts nothing."),
]


def card(name: str, description: str, scenario: str, greeting: str) -> dict[str, Any]:
    """A V2 card."""
    return {
        "spec": "chara_card_v2",
        "spec_version": "2.0",
        "data": {
            "name": name,
            "description": f"{{{{char}}}} is {description}.",
            "personality": "vivid, curious, stays in character",
            "scenario": scenario,
            "first_mes": greeting,
            "mes_example": "",
            "creator_notes": "",
            "system_prompt": "",
            "post_history_instructions": "",
            "alternate_greetings": [],
            "tags": [],
            "creator": "charserve bench",
            "character_version": "1",
            "extensions": {},
        },
    }


def write_dialogues(path: Path, count: int, turns: int, seed: int, prefix: str = "bench") -> None:
    """``count`` dialogues over the bench's characters and personas, ids ``prefix-i``."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(count):
            name, description, scenario, greeting = _CHARACTERS[i % len(_CHARACTERS)]
            persona = _PERSONAS[i % len(_PERSONAS)]
            line = {
                "id": f"{prefix}-{i}",
                "character": card(name, description, scenario, greeting),
                "persona": {"name": persona[0], "description": persona[1]},
                "turns": turns,
                "seed": rng.randrange(1 << 30),
            }
            f.write(json.dumps(line) + "\n")


def write_plans(source: Path, path: Path) -> None:
    """The plans the backfill resolves from ``source`` (for the offline run)."""
    with path.open("w") as f:
        for line_no, raw in enumerate(source.read_text().splitlines(), start=1):
            spec = parse_spec(raw, line_no)
            assert spec.card is not None
            f.write(json.dumps(plan_dialogue(spec, spec.card).to_json()) + "\n")


def engines_running() -> list[str]:
    """Command lines of vLLM engines already on this machine (a stack on the simulated
    engine runs none, so it does not count)."""
    found = subprocess.run(
        ["pgrep", "-af", "vllm|EngineCore"],
        capture_output=True,
        text=True,
        check=False,
    )
    me = str(os.getpid())
    return [
        line
        for line in found.stdout.splitlines()
        if line and not line.startswith(me + " ") and "pgrep" not in line
    ]


class Stack:
    """``charserve up`` as a subprocess in its own session (so it stops as a whole)."""

    def __init__(self, config: str, port: int, log_path: Path, data_dir: Path) -> None:
        env = {
            **os.environ,
            "CHARSERVE_PORT": str(port),
            "CHARSERVE_SERVE_CONFIG": config,
            "CHARSERVE_DATA_DIR": str(data_dir),
            "CHARSERVE_LOG_FORMAT": "json",
        }
        env.pop("CHARSERVE_REDIS_URL", None)
        env.pop("RAY_ADDRESS", None)
        self.base_url = f"http://127.0.0.1:{port}"
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.ops.cli", "up"],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 900) -> None:
        """Block until ``/ready`` answers 200."""
        wait_ready(f"{self.base_url}/ready", self.proc, timeout_s)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the whole session if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything it left behind
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()


async def interactive_until(
    url: str, args: argparse.Namespace, stop: asyncio.Event, seed: int
) -> list[Sample]:
    """An open-loop interactive stream until ``stop`` is set."""
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        return await poisson_stream(
            client,
            url,
            args.model,
            args.interactive_max_tokens,
            args.rate,
            random.Random(seed),
            {"X-Priority": "interactive"},
            stop,
        )


def ttft_summary(samples: list[Sample]) -> dict[str, Any]:
    """TTFT percentiles of the successful samples, and the failures."""
    ok = [s.ttft_s for s in samples if s.ok]
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "ttft_p50_ms": round(percentile(ok, 50) * 1e3, 1),
        "ttft_p99_ms": round(percentile(ok, 99) * 1e3, 1),
        "first_error": next((s.error for s in samples if not s.ok), ""),
    }


def backfill_summary(report: Any) -> dict[str, Any]:
    """The figures of one backfill run."""
    return {
        "dialogues": report.completed,
        "failed": report.failed,
        "requests": report.requests,
        "completion_tokens": report.completion_tokens,
        "elapsed_s": round(report.elapsed_s, 2),
        "completion_tokens_per_s": round(report.completion_tokens_per_s, 1),
    }


async def served_phase(
    url: str, args: argparse.Namespace, source: Path, beside_source: Path, work: Path
) -> dict[str, Any]:
    """Interactive alone; the backfill alone (the dialogues the offline run gets, on a cold
    prefix cache like the offline run's); then a second set of dialogues beside the
    interactive stream."""
    async with httpx.AsyncClient(timeout=120) as client:  # warm-up
        for prompt in USER_PROMPTS:
            await one_request(client, url, args.model, 8, prompt, {"X-Priority": "interactive"})
    counters = read_cpu_times()
    stop = asyncio.Event()
    alone = asyncio.create_task(interactive_until(url, args, stop, args.seed))
    await asyncio.sleep(args.baseline_s)
    stop.set()
    baseline = await alone
    steal = {"interactive_alone": steal_since(counters)}
    counters = read_cpu_times()
    options = Options(
        base_url=url,
        api_key=None,
        model=args.model,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        user_max_tokens=args.user_max_tokens,
        temperature=args.temperature,
        progress=True,
        extra_body={"ignore_eos": True} if args.ignore_eos else {},
    )
    report = await backfill(source, work / "backfill.out.jsonl", options)
    steal["backfill"] = steal_since(counters)
    counters = read_cpu_times()
    stop = asyncio.Event()
    beside = asyncio.create_task(interactive_until(url, args, stop, args.seed + 1))
    try:
        loaded_report = await backfill(beside_source, work / "beside.out.jsonl", options)
    finally:
        stop.set()
    loaded = await beside
    steal["beside"] = steal_since(counters)
    # Each phase with the CPU steal over it: the share of the cores' time the hypervisor
    # took, which a latency figure would otherwise read as the server's stall.
    return {
        "backfill": backfill_summary(report) | steal["backfill"],
        "backfill_with_interactive": backfill_summary(loaded_report) | steal["beside"],
        "interactive_alone": ttft_summary(baseline) | steal["interactive_alone"],
        "interactive_with_backfill": ttft_summary(loaded) | steal["beside"],
    }


def offline_phase(args: argparse.Namespace, plans: Path) -> dict[str, Any]:
    """vLLM's ``LLM.chat`` on the same plans, in its own process."""
    cmd = [
        sys.executable,
        "-m",
        "workers.baselines.offline_chat",
        "--plans",
        str(plans),
        "--config",
        args.config,
        "--max-tokens",
        str(args.max_tokens),
        "--user-max-tokens",
        str(args.user_max_tokens),
        "--temperature",
        str(args.temperature),
    ]
    if args.ignore_eos:
        cmd.append("--ignore-eos")
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the offline run failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """The whole comparison."""
    running = engines_running()
    if running:
        raise RuntimeError("another engine or stack is running:\n" + "\n".join(running))
    work = Path(tempfile.mkdtemp(prefix="charserve-bench-backfill-"))
    source, plans = work / "dialogues.jsonl", work / "plans.jsonl"
    write_dialogues(source, args.dialogues, args.turns, args.seed)
    write_plans(source, plans)
    beside_source = work / "beside.jsonl"
    write_dialogues(beside_source, args.dialogues, args.turns, args.seed + 1, prefix="beside")
    stack = Stack(args.config, args.port or free_port(), work / "up.log", work / "data")
    try:
        stack.wait_ready()
        served = asyncio.run(served_phase(stack.base_url, args, source, beside_source, work))
    finally:
        stack.stop()
    sys.stderr.write(json.dumps(served, indent=2) + "\n")
    offline = offline_phase(args, plans)
    backfill_tps = served["backfill"]["completion_tokens_per_s"]
    loaded = served["interactive_with_backfill"]
    alone = served["interactive_alone"]
    return {
        "config": args.config,
        "work_dir": str(work),
        **served,
        "offline_llm_chat": offline,
        "throughput_ratio": round(backfill_tps / offline["completion_tokens_per_s"], 3),
        "throughput_ratio_with_interactive": round(
            served["backfill_with_interactive"]["completion_tokens_per_s"]
            / offline["completion_tokens_per_s"],
            3,
        ),
        "ttft_p99_ratio": round(loaded["ttft_p99_ms"] / alone["ttft_p99_ms"], 2)
        if alone["ttft_p99_ms"]
        else None,
        "ttft_bound_ms": args.ttft_bound_ms,
        "ttft_p99_within_bound": loaded["ttft_p99_ms"] <= args.ttft_bound_ms
        and loaded["errors"] == 0,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``charserve bench-backfill``."""
    parser.add_argument("--config", default="ray-configs/local-cpu.yaml", help="Serve config")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dialogues", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3, help="character turns per dialogue")
    parser.add_argument("--max-tokens", type=int, default=64, help="per character turn")
    parser.add_argument("--user-max-tokens", type=int, default=32, help="per user turn")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--concurrency", type=int, default=32, help="dialogues in flight")
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every turn exactly max_tokens long, on both sides",
    )
    parser.add_argument("--rate", type=float, default=1.0, help="interactive requests/s")
    parser.add_argument("--interactive-max-tokens", type=int, default=16)
    parser.add_argument("--baseline-s", type=float, default=30.0, help="interactive alone")
    parser.add_argument("--ttft-bound-ms", type=float, default=2000.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="write the JSON result here")


def run(args: argparse.Namespace) -> int:
    """Run the comparison and print it."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    result = bench(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0 if result["throughput_ratio"] >= 0.9 and result["ttft_p99_within_bound"] else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m cluster.bench.backfill``."""
    parser = argparse.ArgumentParser(prog="bench-backfill", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
