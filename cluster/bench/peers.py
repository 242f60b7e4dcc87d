"""``charserve bench-peers``: charserve against vLLM's own server, one server at a time,
measured by vLLM's benchmark client and by ``charserve bench``.

Per round, each peer in turn is started, warmed, measured at every concurrency by every
client, and stopped, so no two engines ever share the cores; even rounds run the peers in
reverse order (:func:`round_order`). A start and a stop take minutes, and the machine's
speed drifts within minutes; with ``--together`` every peer is started once and kept
loaded, and each is frozen (SIGSTOP on every process it started) while another is
measured, so it takes no CPU, and two peers' runs are seconds apart: many small rounds
then compare the servers on the same machine. The peers are:

- ``charserve``: ``charserve up`` (the default config, as ``make run`` serves it);
- ``vllm``: ``python -m vllm.entrypoints.openai.api_server --model M`` with vLLM's own
  defaults: the peer of record, what a user compares with;
- ``vllm-ours``: vLLM's server with charserve's engine settings
  (``python -m workers.baselines.vllm_server``), a second line;
- ``charserve-NAME``, one per ``--charserve-config NAME=PATH``: ``charserve up`` serving
  the Serve config at PATH, so two configs are compared in the same rounds, against the
  same vLLM runs, rather than in runs minutes or hours apart on a machine that drifts.

Two workloads (``--workload``):

- ``chat``: vLLM's ``random`` dataset (``--input-len`` prompt tokens, ``--output-len``
  reply tokens with ``ignore_eos``) for vLLM's client, GuideLLM's ``synthetic_text`` of the
  same sizes (``--clients ... guidellm``), and ``charserve bench`` with the same reply
  length;
- ``persona``: prompts of about 1,000 tokens that share long prefixes, where prefix
  caching matters: vLLM's ``prefix_repetition`` dataset (``--personas`` prefixes of
  ``--persona-len`` tokens, each with ``--suffix-len`` tokens of its own) for vLLM's
  client, and multi-turn conversations (:mod:`cluster.bench.conversations`: ``--personas``
  personas of ``--persona-len`` tokens shared by ``concurrency`` conversations of
  ``prompts / concurrency`` turns) for ours. Its figure of record, ``ttft_later_p50``, is
  the TTFT of requests whose prefix is already cached: turns 2 and later for ours; for
  vLLM's, requests sent after the first of their prefix had finished.

While each client runs, a thread samples the server's ``vllm:num_requests_running`` (vLLM's
own gauge, on both: charserve's gateway ``/metrics`` carries its replicas') and
``running_mean`` is its mean over the client's measured window: the engine's batch size at
that offered load. With ``--step-log`` it is the engine's own instead, every step weighted
by its time (:func:`cluster.bench.steps.summarise`), and the page is not scraped:
charserve's republishes its replicas' gauge every few seconds, a handful of point samples
in a run, and each scrape costs the server CPU while it is measured. Every run's JSON
is kept in ``--out``; the table gives each figure's median over rounds and its ratio to
``vllm`` measured by the same client, then each round's own ratios (:func:`round_ratios`),
whose spread is the machine's noise. Beside them each run reports the CPU steal over its
window (:mod:`cluster.bench.steal`): the share of the cores' time the hypervisor gave
elsewhere, so a run slowed by its neighbours is told apart from a slow server.

Requests carry no priority header unless ``--priority`` names one, the same for every
client and peer (vLLM's server ignores it). Without one, charserve judges them in its
interactive class, whose 2 s budget refuses what it estimates cannot start in time: a
closed-loop client that sends its next request at once, rather than after the refusal's
``Retry-After``, may then spend most of its requests on refusals. ``--priority standard``
(a 30 s budget) measures the serving path alone.

On this machine vLLM's default ``gpu_memory_utilization`` (0.92 of the CPU's NUMA node)
is more than is free once vLLM has loaded, and it refuses to start; ``--vllm-memory``
(0.85) sizes only its KV cache, and is passed to both vLLM peers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import structlog

from cluster.bench import steps
from cluster.bench.samples import percentile
from cluster.bench.steal import (
    CpuTimes,
    gaps_in_clean_windows,
    per_core,
    read_cpu_times,
    window_steal,
)
from cluster.runtime.bundled_model import resolve_model
from cluster.runtime.steplog import STEP_LOG_ENV, read_steps
from cluster.wire.vocabulary import PriorityClass

log = structlog.get_logger(__name__)

SERVED = "smollm2-135m-instruct"
FIGURES = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "tok_s", "running_mean")
PERSONA_FIGURES = (
    "ttft_p50",
    "ttft_later_p50",
    "ttft_p99",
    "itl_p50",
    "itl_p99",
    "tok_s",
    "running_mean",
)
# Totals over the rounds, not medians: a median of refusals hides the round that had them.
COUNTS = ("failed", "refused")
# The machine's, not the server's: shown beside the figures, never as a ratio.
STEAL = "steal_pct"
# The CPU counters are read this often whatever a peer's page poll: steal comes and goes
# within a second, and reading them costs microseconds.
CPU_READ_S = 0.5
# Inter-token gaps that ended in a window of the CPU counters in which no core had this
# share of its time stolen or more are "clean": their tail is the servers' own.
CLEAN_BELOW_PCT = 2.0
# A round's clean ITL figures need this many clean gaps (its p99 then rests on the five
# largest, not on one); with fewer, the round has none.
MIN_CLEAN_GAPS = 500
CLEAN_FIGURES = ("itl_p50_clean", "itl_p99_clean")
CLEAN_SHARE = "clean_gaps_pct"
NAN = float("nan")


@dataclass(frozen=True, slots=True)
class Peer:
    """A server to measure: how to start it, where it answers, and its model name."""

    name: str
    command: list[str]
    port: int
    ready_path: str
    model: str
    env: dict[str, str]
    # Its running-sequences gauge: polled this often, and republished every export_s
    # (0: live, read from the engine's own process). vLLM's server renders its 70 KB
    # page in about 10 ms of CPU: every 0.1 s would take a tenth of a core from the
    # server measured; every 0.5 s is 2%, and still over a hundred samples a minute.
    poll_s: float = 0.5
    export_s: float = 0.0

    @property
    def base_url(self) -> str:
        """Where it answers."""
        return f"http://127.0.0.1:{self.port}"


VARIANT_PREFIX = "charserve-"
# vLLM's own scheduler with a step log, for vLLM's server (--step-log).
LOGGING_SCHEDULER = "workers.engines.steplog.LoggingScheduler"


def variants(specs: list[str] | None) -> dict[str, Path]:
    """``--charserve-config NAME=PATH`` options as {peer name: config path}; refuses a
    malformed one, a name given twice, and a config file that does not exist."""
    found: dict[str, Path] = {}
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,30}", name) or not path:
            raise SystemExit(
                f"--charserve-config {spec!r}: expected NAME=PATH, NAME of lower-case "
                "letters, digits, '-' and '_'"
            )
        peer = VARIANT_PREFIX + name
        if peer in found:
            raise SystemExit(f"--charserve-config: {name!r} given twice")
        if not Path(path).is_file():
            raise SystemExit(f"--charserve-config {name}: no file {path}")
        found[peer] = Path(path).resolve()
    return found


def _charserve(name: str, args: argparse.Namespace, config: Path | None) -> Peer:
    env = {"CHARSERVE_DATA_DIR": str(Path(args.out) / f"{name}-data"), **_step_log_env(name, args)}
    if config is not None:
        env["CHARSERVE_SERVE_CONFIG"] = str(config)
    return Peer(
        name,
        [str(Path(sys.executable).with_name("charserve")), "up"],
        8000,
        "/ready",
        SERVED,
        env,
        # The gateway shows what each worker exported last, every 5 s
        # (cluster.runtime.prometheus.run_worker_exporter), on a page of about 80 KB
        # that costs the gateway about 40 ms of CPU to render: every 2 s sees each
        # export for about 2% of a core.
        poll_s=2.0,
        export_s=5.0,
    )


def _step_log_env(peer: str, args: argparse.Namespace) -> dict[str, str]:
    """With ``--step-log``, the environment that has ``peer``'s engine core log its steps
    into ``OUT/PEER-steps``."""
    if not args.step_log:
        return {}
    return {STEP_LOG_ENV: str((Path(args.out) / f"{peer}-steps").resolve())}


def peers(args: argparse.Namespace, model_path: str) -> dict[str, Peer]:
    """Every peer this run may start."""
    py = sys.executable
    memory = ["--gpu-memory-utilization", str(args.vllm_memory)]
    return {
        "charserve": _charserve("charserve", args, None),
        **{
            name: _charserve(name, args, path)
            for name, path in variants(args.charserve_config).items()
        },
        "vllm": Peer(
            "vllm",
            [
                py,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                model_path,
                "--port",
                "8100",
                *memory,
                # vLLM's own scheduler, logging its steps (only with --step-log).
                *(["--scheduler-cls", LOGGING_SCHEDULER] if args.step_log else []),
            ],
            8100,
            "/v1/models",
            model_path,
            _step_log_env("vllm", args),
        ),
        "vllm-ours": Peer(
            "vllm-ours",
            [py, "-m", "workers.baselines.vllm_server", "--port", "8101"],
            8101,
            "/v1/models",
            SERVED,
            {},
        ),
    }


def _wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before {url}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} not ready in {timeout_s:.0f} s")


def _stop(process: subprocess.Popen[bytes], grace_s: float = 90) -> None:
    """SIGTERM the server (each stops its own children in order), then SIGKILL whatever
    is left of its process group."""
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _vllm_client(
    peer: Peer,
    tokenizer: str,
    concurrency: int,
    prompts: int,
    args: argparse.Namespace,
    out: Path,
    workload: str = "chat",
) -> list[str]:
    if workload == "persona":
        dataset = [
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(args.persona_len),
            "--prefix-repetition-suffix-len", str(args.suffix_len),
            "--prefix-repetition-num-prefixes", str(args.personas),
            "--prefix-repetition-output-len", str(args.output_len),
            # Distinct prefixes per concurrency: a run must not find the last one's cached.
            "--seed", str(concurrency),
            # What read_vllm needs to tell which prefix each request had.
            "--metadata", "dataset=prefix_repetition", f"num_prefixes={args.personas}",
            f"seed={concurrency}",
        ]  # fmt: skip
    else:
        dataset = [
            "--dataset-name", "random",
            "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len),
        ]  # fmt: skip
    return [
        sys.executable, "-m", "workers.baselines.vllm_bench",
        "--backend", "openai-chat",
        "--base-url", peer.base_url,
        "--endpoint", "/v1/chat/completions",
        "--model", peer.model,
        "--tokenizer", tokenizer,
        *dataset,
        "--ignore-eos",
        "--num-prompts", str(prompts),
        "--max-concurrency", str(concurrency),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99",
        # Per-request start times and TTFTs: the measured window, and the persona figures.
        "--save-detailed",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
        *_priority_header(args, "="),  # vLLM's client reads "Name=value"
    ]  # fmt: skip


def _priority_header(args: argparse.Namespace, separator: str = ": ") -> list[str]:
    """``--priority`` as a client's ``--header`` option, its name and value joined by
    ``separator`` (none without it)."""
    return ["--header", f"X-Priority{separator}{args.priority}"] if args.priority else []


def _our_client(
    peer: Peer, concurrency: int, requests: int, args: argparse.Namespace, out: Path
) -> list[str]:
    if args.workload == "persona":
        return [
            sys.executable, "-m", "cluster.bench.conversations",
            "--base-url", peer.base_url,
            "--model", peer.model,
            "--concurrency", str(concurrency),
            "--turns", str(requests // concurrency),
            "--personas", str(args.personas),
            "--persona-len", str(args.persona_len),
            "--max-tokens", str(args.output_len),
            "--seed", str(concurrency),
            "--output", str(out),
            *_priority_header(args),
        ]  # fmt: skip
    return [
        str(Path(sys.executable).with_name("charserve")), "bench",
        "--base-url", peer.base_url,
        "--model", peer.model,
        "--concurrency", str(concurrency),
        "--requests", str(requests),
        "--rounds", "1", "--warmup", "4",
        "--max-tokens", str(args.output_len),
        "--client", args.our_client or "lean",
        # Every gap's time, to place it in the CPU counters' windows (clean_itl).
        "--save-detailed",
        "--output", str(out),
        *_priority_header(args),
    ]  # fmt: skip


def _guidellm_client(
    peer: Peer, tokenizer: str, concurrency: int, prompts: int, args: argparse.Namespace, out: Path
) -> list[str]:
    return [
        args.guidellm, "run",
        "--backend", f"kind=openai_http,target={peer.base_url},model={peer.model}",
        "--profile", f"kind=concurrent,streams={concurrency}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},"
        f"output_tokens={args.output_len}",
        "--constraint", f"kind=max_requests,count={prompts}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]  # fmt: skip


def read_guidellm(path: Path) -> dict[str, float]:
    """The figures of one GuideLLM ``run`` report (its one benchmark)."""
    m = json.loads(path.read_text())["benchmarks"][0]["metrics"]

    def pct(name: str, p: str) -> float:
        return float(m[name]["successful"]["percentiles"][p])

    totals = m["request_totals"]
    return {
        "ttft_p50": pct("time_to_first_token_ms", "p50"),
        "ttft_p99": pct("time_to_first_token_ms", "p99"),
        "itl_p50": pct("inter_token_latency_ms", "p50"),
        "itl_p99": pct("inter_token_latency_ms", "p99"),
        # Output tokens over the benchmark's duration (its "Output Tokens Per Sec").
        "tok_s": float(m["output_tokens_per_second"]["successful"]["mean"]),
        "failed": totals["errored"] + totals["incomplete"],
    }


def read_vllm(path: Path) -> dict[str, float]:
    """The figures of one ``vllm bench serve`` result file (``--save-detailed``: then
    also its refusals, its measured window, and for ``prefix_repetition`` the TTFT p50 of
    the requests whose prefix was cached)."""
    d = json.loads(path.read_text())
    figures = {
        "ttft_p50": d["median_ttft_ms"],
        "ttft_p99": d["p99_ttft_ms"],
        "itl_p50": d["median_itl_ms"],
        "itl_p99": d["p99_itl_ms"],
        "tok_s": d["output_throughput"],
        "failed": d.get("num_prompts", d["completed"]) - d["completed"],
    }
    errors = d.get("errors") or []
    if errors:
        # vLLM's client records a non-200 answer as the status's reason phrase.
        figures["refused"] = sum(1 for e in errors if e and "Too Many Requests" in e)
    if d.get("start_times"):
        ends = [
            s + e
            for s, e, err in zip(d["start_times"], d["latencies"], errors, strict=True)
            if not err
        ]
        figures["start_s"] = min(d["start_times"])
        figures["end_s"] = max(ends, default=figures["start_s"])
    if d.get("dataset") == "prefix_repetition" and d.get("start_times"):
        later = [t * 1000 for t in _later_ttfts(d)]
        figures["ttft_later_p50"] = statistics.median(later) if later else NAN
    return figures


def prefix_order(num_prompts: int, num_prefixes: int, seed: int) -> list[int]:
    """Which prefix each request of vLLM's ``prefix_repetition`` dataset has, in the order
    it sends them: the dataset lists ``num_prompts // num_prefixes`` requests per prefix,
    prefix by prefix, then shuffles them with Python's ``random`` seeded with ``--seed``
    (``PrefixRepetitionRandomDataset``; a test checks this against vLLM's own)."""
    per_prefix = num_prompts // num_prefixes
    order = [p for p in range(num_prefixes) for _ in range(per_prefix)]
    random.Random(seed).shuffle(order)
    return order


def _later_ttfts(d: dict[str, Any]) -> list[float]:
    """TTFTs (s) of the successful requests sent once the first request of their prefix
    had finished, so its prefix was in the cache (what a later turn is for ours)."""
    prefixes = prefix_order(len(d["start_times"]), int(d["num_prefixes"]), int(d["seed"]))
    first_done: dict[int, float] = {}
    for p, start, latency, error in zip(
        prefixes, d["start_times"], d["latencies"], d["errors"], strict=True
    ):
        if not error:
            first_done[p] = min(first_done.get(p, float("inf")), start + latency)
    return [
        ttft
        for p, start, ttft, error in zip(
            prefixes, d["start_times"], d["ttfts"], d["errors"], strict=True
        )
        if not error and start >= first_done[p]
    ]


def read_ours(path: Path) -> dict[str, float]:
    """The figures of one ``charserve bench`` report."""
    report = json.loads(path.read_text())
    t = next(iter(report["targets"].values()))
    return {
        "ttft_p50": t["ttft_p50_ms"],
        "ttft_p99": t["ttft_p99_ms"],
        "itl_p50": t["itl_p50_ms"],
        "itl_p99": t["itl_p99_ms"],
        "tok_s": t["output_tokens_per_s"],
        "failed": t["errors"],
        **_window(report),
    }


def read_conversations(path: Path) -> dict[str, float]:
    """The figures of one :mod:`cluster.bench.conversations` report."""
    r = json.loads(path.read_text())
    return {
        "ttft_p50": r["ttft_p50_ms"],
        "ttft_p99": r["ttft_p99_ms"],
        "ttft_first_p50": r["ttft_first_p50_ms"],
        "ttft_first_p99": r["ttft_first_p99_ms"],
        "ttft_later_p50": r["ttft_later_p50_ms"],
        "ttft_later_p99": r["ttft_later_p99_ms"],
        "itl_p50": r["itl_p50_ms"],
        "itl_p99": r["itl_p99_ms"],
        "tok_s": r["output_tokens_per_s"],
        "failed": r["errors"],
        "refused": r["refused"],
        **_window(r),
    }


def _window(report: dict[str, Any]) -> dict[str, float]:
    w = report.get("window")
    return {"start_s": w["start_s"], "end_s": w["end_s"]} if w else {}


def read_detailed(client: str, workload: str, path: Path) -> dict[str, list[Any]] | None:
    """The per-request record (start, TTFT, gaps, error) in a client's result file: vLLM's
    client's ``--save-detailed`` fields, or ``charserve bench``'s of the same name; None
    for a client that keeps none (GuideLLM as run here, our conversations)."""
    d = json.loads(path.read_text())
    if client == "charserve" and workload == "chat":
        d = next(iter(d["targets"].values())).get("detailed") or {}
    elif client != "vllm":
        return None
    keys = ("start_times", "ttfts", "itls", "errors")
    return {k: d[k] for k in keys} if all(d.get(k) is not None for k in keys) else None


def clean_itl(
    readings: list[tuple[float, CpuTimes]], detailed: dict[str, list[Any]] | None
) -> dict[str, float]:
    """ITL p50 and p99 (ms) over the gaps that ended in windows with no core stolen from
    (:data:`CLEAN_BELOW_PCT`), NaN with fewer than :data:`MIN_CLEAN_GAPS` of them; and the
    percentage of the run's gaps that were clean."""
    if detailed is None:
        return {}
    clean, placed = gaps_in_clean_windows(readings, detailed, CLEAN_BELOW_PCT)
    enough = len(clean) >= MIN_CLEAN_GAPS
    return {
        "itl_p50_clean": percentile(clean, 50) * 1e3 if enough else NAN,
        "itl_p99_clean": percentile(clean, 99) * 1e3 if enough else NAN,
        CLEAN_SHARE: 100.0 * len(clean) / placed if placed else NAN,
    }


READERS = {"vllm": read_vllm, "charserve": read_ours, "guidellm": read_guidellm}


def reader(client: str, workload: str) -> Any:
    """How to read ``client``'s result file for ``workload``."""
    return read_conversations if (client, workload) == ("charserve", "persona") else READERS[client]


_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})? (\S+)", re.MULTILINE)
# Advance whenever an engine makes progress: a new export on charserve's page.
_PROGRESS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")


def parse_running(text: str) -> tuple[float, float]:
    """From a ``/metrics`` page: ``vllm:num_requests_running`` summed over engines, and
    a progress marker (prompt plus generated tokens so far) that changes with every
    export of an engine that did any work."""
    running = progress = 0.0
    for match in _SAMPLE.finditer(text):
        name = match.group(1)
        if name == "vllm:num_requests_running":
            running += float(match.group(3))
        elif name in _PROGRESS:
            progress += float(match.group(3))
    return running, progress


class RunningSampler:
    """Polls a ``/metrics`` page every ``poll_s`` in a thread: (monotonic time, running
    sequences, progress marker) per poll. Small and cheap: one GET and a regex scan. It
    also reads the machine's CPU counters (:mod:`cluster.bench.steal`) every
    :data:`CPU_READ_S` at most, from its start to its stop, so a run's
    CPU steal can be told over its window, in windows of one length for every peer.
    ``url`` None: the counters only (a peer whose step log gives its batch size)."""

    def __init__(self, url: str | None, poll_s: float) -> None:
        self.url = url
        self.poll_s = poll_s
        self.samples: list[tuple[float, float, float]] = []
        self.cpu: list[tuple[float, CpuTimes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="running-sampler", daemon=True)

    def _read_cpu(self) -> None:
        self.cpu.append((time.monotonic(), read_cpu_times()))

    def _poll(self) -> None:
        # The counters at least every CPU_READ_S, the page on every `every`-th of those
        # reads: exactly every poll_s, whatever poll_s is.
        every = max(1, math.ceil(self.poll_s / CPU_READ_S))
        step = self.poll_s / every
        with httpx.Client(timeout=5) as client:
            for tick in itertools.count(1):
                if self._stop.wait(step):
                    break
                self._read_cpu()
                if tick % every or self.url is None:
                    continue
                try:
                    text = client.get(self.url).text
                except httpx.HTTPError:
                    continue
                self.samples.append((time.monotonic(), *parse_running(text)))

    @contextmanager
    def running(self) -> Iterator[RunningSampler]:
        """Sample while the block runs."""
        self._read_cpu()
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()
            self._read_cpu()


def running_mean(
    samples: list[tuple[float, float, float]],
    start_s: float,
    end_s: float,
    poll_s: float,
    export_s: float,
) -> tuple[float, int]:
    """The mean number of running sequences over [start_s, end_s], and how many point
    samples it is of. A live gauge (``export_s`` 0): every poll in the window. A gauge
    republished every ``export_s`` (charserve's page): each export is one point sample,
    taken once, when the progress marker changes; an export in the window is first seen
    up to ``poll_s`` after it."""
    if export_s <= 0:
        picked = [v for t, v, _ in samples if start_s <= t <= end_s]
    else:
        picked = [
            v
            for (_, _, before), (t, v, marker) in itertools.pairwise(samples)
            if marker != before and start_s < t <= end_s + poll_s
        ]
    return (statistics.fmean(picked) if picked else NAN), len(picked)


def round_order(names: list[str], r: int) -> list[str]:
    """The peers in the order round ``r`` (from 1) runs them: as given in odd rounds,
    reversed in even ones, so a machine that drifts one way through a run does not
    always favour the peer measured second."""
    return list(names) if r % 2 else list(reversed(names))


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run every round; one row per (round, peer, client, concurrency)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(None)
    known = peers(args, model_path)
    if args.together:
        return _measure_together(args, known, model_path)
    rows: list[dict[str, Any]] = []
    for r in range(1, args.rounds + 1):
        for name in round_order(args.peers, r):
            peer = known[name]
            process, logfile = _start(peer, out / f"{name}-server-{r}.log")
            try:
                _wait_ready(peer.base_url + peer.ready_path, process, 600)
                log.info("peer up", peer=name, round=r)
                _warm(peer, model_path, args, out / f"{name}-warmup-{r}.json")
                rows.extend(_measure_peer(peer, model_path, args, r))
            finally:
                _stop(process)
                logfile.close()
            time.sleep(5)  # the engine's memory returns to the machine
    return rows


def _start(peer: Peer, log_path: Path) -> tuple[subprocess.Popen[bytes], Any]:
    """Start ``peer`` in a session of its own (so its whole tree can be signalled)."""
    logfile = log_path.open("wb")
    process = subprocess.Popen(
        peer.command,
        stdout=logfile,
        stderr=subprocess.STDOUT,
        env={**os.environ, **peer.env},
        start_new_session=True,
    )
    return process, logfile


def _warm(peer: Peer, model_path: str, args: argparse.Namespace, path: Path) -> None:
    """Four requests at one stream, not measured: compiled paths and caches warm."""
    subprocess.run(
        _vllm_client(peer, model_path, 1, 4, args, path), check=True, capture_output=True
    )


def _measure_peer(
    peer: Peer, model_path: str, args: argparse.Namespace, r: int
) -> list[dict[str, Any]]:
    """Every client at every concurrency against ``peer``, in round ``r``."""
    rows = []
    for concurrency, prompts in zip(args.concurrency, args.prompts, strict=True):
        for client in args.clients:
            row = _measure_one(peer, client, concurrency, prompts, model_path, args, r)
            if row is not None:
                rows.append(row)
    return rows


def tree_pids(leader: int, proc: Path = Path("/proc")) -> list[int]:
    """Every process of a server ``leader`` started (its own pid first): its descendants
    and the members of its session, with theirs. A ``charserve up`` starts its gateway
    and Redis in sessions of their own, and Ray's workers are the raylet's children, so
    neither relation alone finds them all."""
    parent: dict[int, int] = {}
    members = {leader}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # After the name (in parentheses, which may hold spaces): state, ppid, pgrp, session.
        fields = stat.rsplit(")", 1)[1].split()
        pid, ppid, session = int(entry.name), int(fields[1]), int(fields[3])
        parent[pid] = ppid
        if session == leader:
            members.add(pid)
    grew = True
    while grew:
        more = {pid for pid, ppid in parent.items() if ppid in members} - members
        members |= more
        grew = bool(more)
    return sorted(members, key=lambda pid: (pid != leader, pid))


def signal_tree(leader: int, sig: int) -> None:
    """Send ``sig`` to every process of the server ``leader`` started."""
    for pid in tree_pids(leader):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass  # gone meanwhile


def _freeze(process: subprocess.Popen[bytes]) -> None:
    """Stop every process of a server: it takes no CPU while another is measured."""
    signal_tree(process.pid, signal.SIGSTOP)


def _thaw(process: subprocess.Popen[bytes]) -> None:
    """Let a frozen server's processes run again."""
    signal_tree(process.pid, signal.SIGCONT)


def _measure_together(
    args: argparse.Namespace, known: dict[str, Peer], model_path: str
) -> list[dict[str, Any]]:
    """``--together``: every peer is started once and stays loaded; each is measured in
    turn while the others are frozen (SIGSTOP on every process they started, so their
    engines, Ray, Redis and gateways take no CPU at all), and thawed for their own runs after
    ``--pause-s`` to settle. The runs of two peers are then seconds apart, not the minutes
    a start and stop take, so many small rounds see the same machine."""
    out = Path(args.out)
    started: dict[str, tuple[subprocess.Popen[bytes], Any]] = {}
    rows: list[dict[str, Any]] = []
    try:
        for name in args.peers:
            peer = known[name]
            process, logfile = _start(peer, out / f"{name}-server.log")
            started[name] = (process, logfile)
            _wait_ready(peer.base_url + peer.ready_path, process, 600)
            _warm(peer, model_path, args, out / f"{name}-warmup.json")
            _freeze(process)
            log.info("peer up, frozen until its turn", peer=name)
        for r in range(1, args.rounds + 1):
            for name in round_order(args.peers, r):
                peer, (process, _) = known[name], started[name]
                _thaw(process)
                try:
                    # Its heartbeats and presence lapsed while it was frozen: ready again first.
                    _wait_ready(peer.base_url + peer.ready_path, process, 120)
                    time.sleep(args.pause_s)
                    rows.extend(_measure_peer(peer, model_path, args, r))
                finally:
                    _freeze(process)
    finally:
        for process, logfile in started.values():
            _thaw(process)  # a stopped process cannot act on SIGTERM
            _stop(process)
            logfile.close()
    return rows


def _measure_one(
    peer: Peer,
    client: str,
    concurrency: int,
    prompts: int,
    model_path: str,
    args: argparse.Namespace,
    r: int,
) -> dict[str, Any] | None:
    """One client's run against one peer, sampling its running sequences meanwhile."""
    out = Path(args.out)
    path = out / f"{peer.name}-{client}-{args.workload}-c{concurrency}-{r}.json"
    if client == "vllm":
        cmd = _vllm_client(peer, model_path, concurrency, prompts, args, path, args.workload)
    elif client == "guidellm":
        cmd = _guidellm_client(peer, model_path, concurrency, prompts, args, path)
    else:
        cmd = _our_client(peer, concurrency, prompts, args, path)
    path.unlink(missing_ok=True)  # an earlier run's report is not this run's
    # A peer whose engine logs its steps gives its batch size exactly: no page to scrape
    # (each scrape costs the server under measure CPU), no republished gauge to wait for.
    step_log = peer.env.get(STEP_LOG_ENV)
    sampler = RunningSampler(None if step_log else f"{peer.base_url}/metrics", peer.poll_s)
    with sampler.running():
        started_s = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True)
        ended_s = time.monotonic()
        # A republished gauge shows the run's last moments up to export_s late.
        time.sleep(peer.export_s + peer.poll_s if peer.export_s and not step_log else 0)
    (out / f"{path.stem}.txt").write_text(done.stdout + done.stderr)
    (out / f"{path.stem}.running.json").write_text(json.dumps(sampler.samples))
    (out / f"{path.stem}.cpu.json").write_text(json.dumps(sampler.cpu))
    if done.returncode != 0:
        log.warning("client failed", peer=peer.name, client=client, path=str(path))
    if not path.exists():  # a client that failed may still have written its report
        return None
    figures = reader(client, args.workload)(path)
    clean = clean_itl(sampler.cpu, read_detailed(client, args.workload, path))
    # The client's measured window when it reports one, else its whole run.
    start_s, end_s = figures.pop("start_s", started_s), figures.pop("end_s", ended_s)
    steal = window_steal(sampler.cpu, start_s, end_s)
    row: dict[str, Any] = {"round": r, "peer": peer.name, "client": client, "c": concurrency}
    if step_log:  # every step of the window, not a sampled gauge
        engine = steps.summarise(read_steps(Path(step_log), start_s, end_s))
        row["engine_steps"] = engine
        mean, points = float(engine.get("running_mean", NAN)), int(engine.get("steps", 0))
    else:
        mean, points = running_mean(sampler.samples, start_s, end_s, peer.poll_s, peer.export_s)
    return {
        **row,
        **figures,
        "running_mean": mean,
        "running_points": points,
        # Percent of the machine's CPU time (all cores), and of each core's, stolen.
        STEAL: steal.get("cpu", NAN),
        "steal_pct_cores": per_core(steal),
        **clean,
    }


def figures_of(workload: str) -> tuple[str, ...]:
    """The figures the table shows for ``workload``."""
    return PERSONA_FIGURES if workload == "persona" else FIGURES


def _is_number(value: Any) -> bool:
    """A figure a run took (not missing, not NaN)."""
    return isinstance(value, int | float) and value == value


def _median(values: list[float]) -> float:
    """The median of the values that are numbers (NaN: a figure the run could not take)."""
    numbers = [v for v in values if _is_number(v)]
    return statistics.median(numbers) if numbers else NAN


def _total(values: list[float]) -> float:
    """The sum of the values that are numbers (NaN when no run reported the count)."""
    numbers = [v for v in values if _is_number(v)]
    return sum(numbers) if numbers else NAN


def _ratio(value: Any, ref: Any) -> float | None:
    """``value / ref`` when both are figures a run took and ``ref`` is not zero."""
    return value / ref if _is_number(value) and _is_number(ref) and ref else None


def round_ratios(
    mine: list[dict[str, Any]], ref: list[dict[str, Any]], figures: tuple[str, ...]
) -> dict[str, list[float]]:
    """Each figure's ratio of ``mine`` to ``ref`` (the same client's runs of ``vllm``)
    within every round that measured both, in round order: their spread is the machine's
    noise between two servers run minutes apart, which one ratio of medians hides."""
    by_round = {row["round"]: row for row in ref}
    pairs = [(row, by_round[row["round"]]) for row in mine if row["round"] in by_round]
    pairs.sort(key=lambda pair: pair[0]["round"])
    ratios: dict[str, list[float]] = {}
    for f in figures:
        values = [round(x, 3) for a, b in pairs if (x := _ratio(a.get(f), b.get(f))) is not None]
        if values:
            ratios[f] = values
    return ratios


def table(rows: list[dict[str, Any]], workload: str = "chat") -> tuple[str, dict[str, Any]]:
    """Medians over rounds, and each figure's ratio to ``vllm`` by the same client; with
    more than one round, each round's own ratios too. Failed and refused requests are
    totals over the rounds."""
    figures = figures_of(workload)
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["client"], row["peer"], row["c"]), []).append(row)
    medians = {
        key: {
            **{
                f: _median([r.get(f, NAN) for r in rs])
                for f in (*figures, STEAL, *CLEAN_FIGURES, CLEAN_SHARE)
            },
            **{f: _total([r.get(f, NAN) for r in rs]) for f in COUNTS},
        }
        for key, rs in groups.items()
    }
    pw = max([10, *(len(peer) for _, peer, _ in groups)])  # the peer column's width
    lines = [
        f"{'client':<9} {'c':>3} {'peer':<{pw}} "
        + " ".join(f"{f:>15}" for f in figures)
        + "".join(f" {f:>7}" for f in COUNTS)
        + f" {'steal%':>6} {'runs':>4}"
    ]
    summary: dict[str, Any] = {}
    spread: list[str] = []
    stolen: list[str] = []
    clean: list[str] = []
    for (client, peer, c), m in sorted(medians.items()):
        ref = medians.get((client, "vllm", c))
        ratios = (
            {f: x for f in (*figures, *CLEAN_FIGURES) if (x := _ratio(m[f], ref[f])) is not None}
            if ref and peer != "vllm"
            else {}
        )
        cells = [f"{m[f]:>7.1f}" + (f" ({ratios[f]:.2f}x)" if f in ratios else "") for f in figures]
        lines.append(
            f"{client:<9} {c:>3} {peer:<{pw}} "
            + " ".join(f"{cell:>15}" for cell in cells)
            + "".join(f" {m[f]:>7.0f}" if m[f] == m[f] else f" {'-':>7}" for f in COUNTS)
            + (f" {m[STEAL]:>6.1f}" if _is_number(m[STEAL]) else f" {'-':>6}")
            + f" {len(groups[(client, peer, c)]):>4}"
        )
        with_clean = sum(_is_number(r.get(CLEAN_FIGURES[-1])) for r in groups[(client, peer, c)])
        if with_clean:
            clean.append(
                f"{client:<9} {c:>3} {peer:<{pw}} "
                + " ".join(
                    f"{m[f]:>7.1f}" + (f" ({ratios[f]:.2f}x)" if f in ratios else "")
                    for f in CLEAN_FIGURES
                )
                + f"  {m[CLEAN_SHARE]:.0f}% of gaps clean, {with_clean} rounds"
            )
        in_order = sorted(groups[(client, peer, c)], key=lambda row: row["round"])
        steals = [row.get(STEAL, NAN) for row in in_order]
        if len(steals) > 1 and any(_is_number(v) for v in steals):
            stolen.append(
                f"{client:<9} {c:>3} {peer:<{pw}} "
                + "/".join(f"{v:.1f}" if _is_number(v) else "-" for v in steals)
            )
        per_round = (
            round_ratios(groups[(client, peer, c)], groups[(client, "vllm", c)], figures)
            if ratios
            else {}
        )
        summary[f"{client}/{peer}/c{c}"] = {
            **m,
            **{f"{f}_over_vllm": round(v, 3) for f, v in ratios.items()},
            **{f"{f}_over_vllm_by_round": v for f, v in per_round.items()},
        }
        if any(len(v) > 1 for v in per_round.values()):
            spread.append(
                f"{client:<9} {c:>3} {peer:<{pw}} "
                + "  ".join(
                    f"{f} " + "/".join(f"{v:.2f}" for v in vs) for f, vs in per_round.items()
                )
            )
    if spread:
        lines += ["", "each round's own ratios to vllm, by the same client:", *spread]
    stepped = [row for row in rows if row.get("engine_steps")]
    if stepped:
        lines += [
            "",
            "engine steps per run: requests started per step (size×steps), and the share of "
            "decodes that waited for a prefill in their step:",
            *(step_line(row, pw) for row in sorted(stepped, key=_run_order)),
        ]
    if stolen:
        lines += ["", "CPU steal in each round, percent of all cores' time:", *stolen]
    if clean:
        lines += [
            "",
            f"ITL p50, p99 (ms) of the gaps that ended while no core had {CLEAN_BELOW_PCT:g}%"
            f" of its time stolen (median over the rounds with {MIN_CLEAN_GAPS}+ such gaps):",
            *clean,
        ]
    return "\n".join(lines), summary


def _run_order(row: dict[str, Any]) -> tuple[str, int, str, int]:
    return row["client"], row["c"], row["peer"], row["round"]


def step_line(row: dict[str, Any], width: int) -> str:
    """One run's engine steps (``row["engine_steps"]``) as a line of the table."""
    e = row["engine_steps"]
    return (
        f"{row['client']:<9} {row['c']:>3} {row['peer']:<{width}} round {row['round']}: "
        f"{e['steps']} steps, {e['arrival_steps']} starting requests ({e['arrivals']}), "
        f"{e['stalled_pct']:.2f}% of decodes stalled, decode step {e['decode_step_ms']} ms"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``charserve bench-peers``."""
    parser.add_argument(
        "--peers",
        nargs="+",
        default=["vllm", "charserve"],
        help="of charserve, vllm, vllm-ours and charserve-NAME for each --charserve-config",
    )
    parser.add_argument(
        "--charserve-config",
        action="append",
        metavar="NAME=PATH",
        help="a peer charserve-NAME: `charserve up` serving the Serve config at PATH "
        "(repeatable); name it in --peers",
    )
    parser.add_argument("--clients", nargs="+", default=["vllm", "charserve"],
                        choices=["vllm", "charserve", "guidellm"])  # fmt: skip
    parser.add_argument(
        "--our-client",
        choices=["lean", "httpx"],
        default=None,
        help="chat workload: charserve bench's HTTP client (default lean, which takes about "
        "a tenth of httpx's CPU per token: CPU the servers measured share on a small machine)",
    )
    parser.add_argument(
        "--guidellm",
        default="guidellm",
        help="GuideLLM's command, for --clients guidellm (install it in a venv of its own: "
        "its dependencies differ from vLLM's)",
    )
    parser.add_argument(
        "--workload",
        choices=["chat", "persona"],
        default="chat",
        help="chat: short random prompts; persona: ~1,000-token prompts sharing persona "
        "prefixes (vLLM's prefix_repetition dataset, and multi-turn conversations)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument(
        "--prompts",
        type=int,
        nargs="+",
        default=[24, 160],
        help="per concurrency, in order (persona: a multiple of the concurrency and of "
        "--personas; our client runs prompts/concurrency turns per conversation)",
    )
    parser.add_argument("--input-len", type=int, default=50, help="chat: prompt tokens")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--personas", type=int, default=4, help="persona: characters (prefixes), shared"
    )
    parser.add_argument("--persona-len", type=int, default=900, help="persona: its tokens")
    parser.add_argument(
        "--suffix-len",
        type=int,
        default=100,
        help="persona: tokens after the prefix in vLLM's client (ours sends the history)",
    )
    parser.add_argument("--vllm-memory", type=float, default=0.85)
    parser.add_argument(
        "--priority",
        choices=[str(c) for c in PriorityClass],
        help="X-Priority sent by every client to every peer (vLLM's server ignores it); "
        "default none: charserve's interactive class, whose 2 s budget refuses what it "
        "cannot start in time (standard: a 30 s budget, the serving path without refusals)",
    )
    parser.add_argument(
        "--together",
        action="store_true",
        help="start every peer once and keep them loaded, each frozen (SIGSTOP) while "
        "another is measured: runs seconds apart rather than minutes, for many small "
        "rounds (the engines' memory must fit together: lower --vllm-memory)",
    )
    parser.add_argument(
        "--pause-s",
        type=float,
        default=2.0,
        help="--together: seconds a thawed peer settles before its runs",
    )
    parser.add_argument(
        "--step-log",
        action="store_true",
        help="log every engine step of charserve and of vLLM's server (in OUT/PEER-steps) "
        "and show, per run, how the streams reached the engine and the share of decodes "
        "that waited for another request's prefill",
    )
    parser.add_argument("--out", default="bench-peers", help="every run's result files")


def check(args: argparse.Namespace) -> None:
    """Refuse option combinations a run would fail on, before starting any server."""
    if len(args.concurrency) != len(args.prompts):
        raise SystemExit("--prompts gives one count per --concurrency")
    known = list(peers(args, model_path="M"))  # the names only: no model is needed
    unknown = [p for p in args.peers if p not in known]
    if unknown:
        raise SystemExit(f"--peers: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    if len(set(args.peers)) != len(args.peers):
        raise SystemExit("--peers: a peer named twice")
    if args.together:
        stacks = [p for p in args.peers if p == "charserve" or p.startswith(VARIANT_PREFIX)]
        if len(stacks) > 1:
            # Each `charserve up` serves port 8000 and starts a Ray of its own.
            raise SystemExit(
                f"--together runs one charserve peer at most (not {', '.join(stacks)})"
            )
        if not 0 <= args.pause_s <= 60:
            raise SystemExit("--pause-s: from 0 to 60 seconds")
    if args.priority and "guidellm" in args.clients:
        raise SystemExit("--priority: GuideLLM's client here sends no extra header")
    if args.workload != "persona":
        return
    if "guidellm" in args.clients:
        raise SystemExit("--workload persona runs with --clients vllm charserve")
    if args.our_client:
        raise SystemExit("--our-client is for --workload chat (persona runs conversations)")
    for c, n in zip(args.concurrency, args.prompts, strict=True):
        if n % c or n % args.personas or n < 2 * c:
            raise SystemExit(
                f"--workload persona: --prompts {n} must be a multiple of the concurrency "
                f"({c}) and of --personas ({args.personas}), and at least two turns each"
            )


def run(args: argparse.Namespace) -> int:
    """Measure, print the table, write ``summary.json`` into ``--out``."""
    check(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per sample
    rows = measure(args)
    text, summary = table(rows, args.workload)
    Path(args.out, "summary.json").write_text(
        json.dumps(
            {
                "workload": args.workload,
                "priority": args.priority,
                "rows": rows,
                "summary": summary,
            },
            indent=2,
        )
    )
    print(text)
    return 0
