"""``charserve bench``: a streaming load generator for any OpenAI-compatible server.

Closed loop at a fixed concurrency (``--concurrency``) or open loop at a Poisson rate
(``--rate``). Per request it records TTFT (first content token), the gaps between content
chunks (ITL), TPOT ((end-to-end - TTFT) / (tokens - 1)), end to end, and tokens from the
server's own usage report. ``--compare URL`` runs the identical workload against a second
server in the same run, alternating rounds (A, B, A, B, ...) so both see the same machine
conditions, and prints the ratios of the first URL's figures over the second's.

Requests ask for exactly ``--max-tokens`` tokens (``ignore_eos``), so both servers do the
same work. Each target's report carries the CPU steal over its rounds (``cpu_steal_pct``:
the share of the machine's CPU time the hypervisor gave elsewhere, which the latencies
would otherwise show as the server's stalls). ``--extra-body JSON`` adds fields to every
request's body (e.g. the roleplay samplers' ``{"dry_multiplier": 0.8}``, to measure what
they cost).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import resource
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from cluster.bench.samples import Sample, StreamTimer, detailed, percentile
from cluster.bench.steal import StealTotals, read_cpu_times, steal_fields
from cluster.runtime import gc_policy as heap

SYSTEM_PROMPT = (
    "You are Captain Mira Vance, the sharp-tongued but kind captain of the starship "
    "Wayfarer. You speak in short, vivid sentences and never break character."
)
USER_PROMPTS = [
    "Captain, the engines are making that noise again. What do we do?",
    "Tell me about the first time you flew through the Kessler Belt.",
    "Are we going to make it to the outpost before the storm hits?",
    "What do you think of the new navigator?",
]


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    max_tokens: int,
    prompt: str,
    headers: dict[str, str] | None = None,
    messages: list[dict[str, str]] | None = None,
    extra: dict[str, Any] | None = None,
) -> Sample:
    """Send one streaming chat completion and time it (``messages`` replaces the default
    system prompt plus ``prompt``, and an empty list sends none; ``extra`` adds body
    fields)."""
    body = {**request_body(model, max_tokens, prompt), **(extra or {})}
    if messages is not None:
        body["messages"] = messages
    if not body["messages"]:  # a session action: the session holds the conversation
        del body["messages"]
    timer = StreamTimer(time.perf_counter())
    try:
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=headers
        ) as resp:
            timer.sample.status = resp.status_code
            if resp.status_code != 200:
                timer.sample.error = f"HTTP {resp.status_code}: {(await resp.aread())[:400]!r}"
                timer.sample.e2e_s = time.perf_counter() - timer.sample.start_s
                return timer.sample
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if not timer.event(json.loads(line[6:]), time.perf_counter()):
                    return timer.sample
        return timer.finish(time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        timer.sample.error = f"{type(exc).__name__}: {exc}"
        return timer.sample


async def poisson_stream(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    max_tokens: int,
    rate: float,
    rng: random.Random,
    headers: dict[str, str],
    stop: asyncio.Event,
) -> list[Sample]:
    """An open-loop stream: requests at Poisson arrivals of ``rate`` per second, each
    sent without waiting for earlier ones, until ``stop`` is set; then every sample."""
    tasks: list[asyncio.Task[Sample]] = []
    while not stop.is_set():
        tasks.append(
            asyncio.create_task(
                one_request(client, url, model, max_tokens, rng.choice(USER_PROMPTS), headers)
            )
        )
        try:
            await asyncio.wait_for(stop.wait(), rng.expovariate(rate))
        except TimeoutError:
            pass
    return list(await asyncio.gather(*tasks))


async def run_round(
    url: str,
    model: str,
    requests: int,
    concurrency: int,
    rate: float | None,
    max_tokens: int,
    seed: int,
    headers: dict[str, str] | None = None,
    client: str = "httpx",
    ramp_s: float = 0.0,
    extra: dict[str, Any] | None = None,
) -> tuple[list[Sample], float]:
    """One round: ``requests`` requests closed-loop at ``concurrency``, or open-loop at
    ``rate`` per second (``extra``: fields added to every body). Returns the samples and
    the round's wall time.

    ``client="lean"`` uses :class:`cluster.bench.lean_client.LeanClient` instead of httpx (same
    measurements, far less CPU). ``ramp_s`` starts the closed-loop workers evenly over
    that many seconds instead of all at once, so equal-length replies do not keep
    arriving and ending in lockstep."""
    rng = random.Random(seed)
    prompts = [rng.choice(USER_PROMPTS) for _ in range(requests)]
    if client == "lean":
        return await _lean_round(
            url, model, prompts, concurrency, rate, max_tokens, rng, headers or {}, ramp_s, extra
        )
    limits = httpx.Limits(
        max_connections=max(concurrency, 64), max_keepalive_connections=max(concurrency, 64)
    )
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:

        def send(prompt: str) -> Awaitable[Sample]:
            return one_request(http, url, model, max_tokens, prompt, headers, extra=extra)

        return await drive(send, prompts, concurrency, rate, rng, ramp_s)


async def drive(
    send: Callable[[str], Awaitable[Sample]],
    prompts: list[str],
    concurrency: int,
    rate: float | None,
    rng: random.Random,
    ramp_s: float,
) -> tuple[list[Sample], float]:
    """Send every prompt closed-loop at ``concurrency`` (workers started over ``ramp_s``),
    or open-loop at Poisson arrivals of ``rate`` per second; the samples and wall time."""
    start = time.perf_counter()
    if rate is None:
        queue = list(prompts)
        samples: list[Sample] = []

        async def worker(i: int) -> None:
            await asyncio.sleep(ramp_s * i / concurrency)
            while queue:
                samples.append(await send(queue.pop()))

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    else:
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(send(prompt)))
            await asyncio.sleep(rng.expovariate(rate))
        samples = list(await asyncio.gather(*tasks))
    return samples, time.perf_counter() - start


def request_body(model: str, max_tokens: int, prompt: str) -> dict[str, Any]:
    """The chat completion every benchmark request sends."""
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": prompt},
        ],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _lean_round(
    url: str,
    model: str,
    prompts: list[str],
    concurrency: int,
    rate: float | None,
    max_tokens: int,
    rng: random.Random,
    headers: dict[str, str],
    ramp_s: float,
    extra: dict[str, Any] | None = None,
) -> tuple[list[Sample], float]:
    from cluster.bench.lean_client import LeanClient

    lean = LeanClient(url)
    encoded = {
        p: lean.request_bytes(
            "/v1/chat/completions", {**request_body(model, max_tokens, p), **(extra or {})}, headers
        )
        for p in set(prompts)
    }
    try:
        return await drive(
            lambda prompt: lean.stream(encoded[prompt]), prompts, concurrency, rate, rng, ramp_s
        )
    finally:
        lean.close()


def cpu_s() -> float:
    """CPU time (user + system) this process has used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _round_in_process(kwargs: dict[str, Any]) -> tuple[list[Sample], float, float]:
    """One share of a round in a worker process (uvloop when available); its samples,
    wall time and the CPU time the process spent on the round."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    heap.settle()
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        before = cpu_s()
        samples, wall_s = runner.run(run_round(**kwargs))
        return samples, wall_s, cpu_s() - before


def _loop_factory() -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop ships with the gateway's extras
        return None
    return uvloop.new_event_loop


async def run_round_procs(procs: int, **kwargs: Any) -> tuple[list[Sample], float, float]:
    """:func:`run_round` spread over ``procs`` processes (concurrency, requests and rate
    divided between them, each with its own seed); the samples of all, the longest wall
    time, and the load generator's CPU time over the round (every process's own, summed,
    plus this one's), so a capacity run shows how much of the machine the client took."""
    before = cpu_s()
    if procs <= 1:
        samples, wall_s = await run_round(**kwargs)
        return samples, wall_s, cpu_s() - before
    from concurrent.futures import ProcessPoolExecutor

    shares = []
    for i in range(procs):
        share = dict(kwargs)
        share["requests"] = kwargs["requests"] // procs + (i < kwargs["requests"] % procs)
        share["concurrency"] = max(
            1, kwargs["concurrency"] // procs + (i < kwargs["concurrency"] % procs)
        )
        share["seed"] = kwargs["seed"] * 1000 + i
        if kwargs.get("rate") is not None:
            share["rate"] = kwargs["rate"] / procs
        shares.append(share)
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(procs) as pool:
        results = await asyncio.gather(
            *(loop.run_in_executor(pool, _round_in_process, s) for s in shares)
        )
    return (
        [x for samples, _, _ in results for x in samples],
        max(w for _, w, _ in results),
        sum(c for _, _, c in results) + cpu_s() - before,
    )


def summarize(
    samples: list[Sample],
    wall_s: float,
    slo_ttft_ms: float = 1000.0,
    slo_tpot_ms: float = 100.0,
    client_cpu_s: float | None = None,
    steal: StealTotals | None = None,
) -> dict[str, Any]:
    """Percentiles (ms), throughput, goodput and error count for a set of samples.

    Goodput counts only requests that met both SLOs (TTFT and TPOT), per second. With
    ``client_cpu_s`` (the load generator's CPU time over the rounds) also its CPU per
    received ``data:`` event and per output token (µs). With ``steal`` (the machine's CPU
    counters over the rounds) also the percentage of CPU time the hypervisor took, of all
    cores and of each (:mod:`cluster.bench.steal`; absent where there are no counters).
    """
    ok = [s for s in samples if s.ok]
    itl = [x for s in ok for x in s.itl_s]
    out: dict[str, Any] = {"requests": len(samples), "errors": len(samples) - len(ok)}
    for name, values in (
        ("ttft", [s.ttft_s for s in ok]),
        ("itl", itl),
        ("tpot", [s.tpot_s for s in ok if s.output_tokens > 1]),
        ("e2e", [s.e2e_s for s in ok]),
    ):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = round(percentile(values, q) * 1000.0, 2)
    good = [s for s in ok if s.ttft_s * 1e3 <= slo_ttft_ms and s.tpot_s * 1e3 <= slo_tpot_ms]
    out["goodput_requests_per_s"] = round(len(good) / wall_s, 3) if wall_s > 0 else 0.0
    out["slo_attained"] = round(len(good) / len(samples), 3) if samples else 0.0
    out["output_tokens"] = sum(s.output_tokens for s in ok)
    out["output_tokens_per_s"] = round(out["output_tokens"] / wall_s, 2) if wall_s > 0 else 0.0
    if client_cpu_s is not None:
        events = sum(s.events for s in samples)
        out["client_cpu_s"] = round(client_cpu_s, 3)
        out["client_cpu_us_per_event"] = round(client_cpu_s * 1e6 / events, 2) if events else 0.0
        out["client_cpu_us_per_token"] = (
            round(client_cpu_s * 1e6 / out["output_tokens"], 2) if out["output_tokens"] else 0.0
        )
    out.update(steal_fields(steal.percent()) if steal is not None else {})
    errors = [s.error for s in samples if not s.ok]
    if errors:
        out["first_error"] = errors[0]
    return out


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole benchmark; return per-target summaries and ratios."""
    targets = [args.base_url] + ([args.compare] if args.compare else [])
    headers = parse_headers(args.header)
    extra = extra_body(getattr(args, "extra_body", None))
    for url in targets:  # warm-up, not measured
        if args.warmup:
            await run_round(
                url,
                args.model,
                args.warmup,
                min(args.concurrency, args.warmup),
                None,
                args.max_tokens,
                0,
                headers,
                client=args.client,
                extra=extra,
            )
    collected: dict[str, tuple[list[Sample], float]] = {u: ([], 0.0) for u in targets}
    client_cpu_s = dict.fromkeys(targets, 0.0)
    steal = {u: StealTotals() for u in targets}
    measured_from_s = time.perf_counter()  # the system's monotonic clock, as vLLM's client
    for r in range(args.rounds):
        for url in targets:
            counters = read_cpu_times()
            samples, wall, cpu = await run_round_procs(
                args.procs,
                url=url,
                model=args.model,
                requests=args.requests,
                concurrency=args.concurrency,
                rate=args.rate,
                max_tokens=args.max_tokens,
                seed=r + 1,
                headers=headers,
                client=args.client,
                ramp_s=args.ramp_s,
                extra=extra,
            )
            before, total = collected[url]
            collected[url] = (before + samples, total + wall)
            client_cpu_s[url] += cpu
            steal[url].add(counters, read_cpu_times())
    result: dict[str, Any] = {
        "workload": {
            "concurrency": args.concurrency,
            "rate": args.rate,
            "requests_per_round": args.requests,
            "rounds": args.rounds,
            "headers": headers,
            "max_tokens": args.max_tokens,
            "model": args.model,
            "client": args.client,
            "procs": args.procs,
            "ramp_s": args.ramp_s,
            "extra_body": extra,
        },
        # When the measured rounds ran (warm-up excluded): what else ran meanwhile, such
        # as ``charserve bench-peers``'s sampling of the server's running sequences.
        "window": {"start_s": measured_from_s, "end_s": time.perf_counter()},
        "targets": {
            u: summarize(
                *collected[u], args.slo_ttft_ms, args.slo_tpot_ms, client_cpu_s[u], steal[u]
            )
            for u in targets
        },
    }
    if args.save_detailed:
        for u in targets:
            result["targets"][u]["detailed"] = detailed(collected[u][0])
    if args.plot:
        plot(collected, args.plot)
    if args.compare:
        a, b = result["targets"][args.base_url], result["targets"][args.compare]
        result["ratios"] = {
            k: round(a[k] / b[k], 3) for k in a if k.endswith(("_ms", "_per_s")) and b.get(k)
        }
    return result


def parse_headers(values: list[str]) -> dict[str, str]:
    """``--header "Name: value"`` options as a dict (a malformed one exits, naming it)."""
    headers = {}
    for value in values:
        name, sep, text = value.partition(":")
        if not sep or not name.strip():
            raise SystemExit(f'--header {value!r}: expected "Name: value"')
        headers[name.strip()] = text.strip()
    return headers


def add_header_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--header`` option, repeatable, that :func:`parse_headers` reads."""
    parser.add_argument(
        "--header", action="append", default=[], help='extra request header, "Name: value"'
    )


def extra_body(text: str | None) -> dict[str, Any]:
    """``--extra-body``: a JSON object whose fields every request's body gets."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise SystemExit(f"--extra-body is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise SystemExit("--extra-body must be a JSON object")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``charserve bench``."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--compare", default=None, help="second server, same workload, same run")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--rate", type=float, default=None, help="open loop: requests/s")
    parser.add_argument("--requests", type=int, default=20, help="requests per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", default=None, help="write the JSON result here")
    add_header_argument(parser)
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput TTFT SLO")
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0, help="goodput TPOT SLO")
    parser.add_argument("--plot", default=None, help="write latency CDFs and throughput PNG")
    parser.add_argument(
        "--client",
        choices=("httpx", "lean"),
        default="httpx",
        help="lean: a raw asyncio HTTP/1.1 SSE client (same measurements, far less CPU)",
    )
    parser.add_argument(
        "--save-detailed",
        action="store_true",
        help="also write every request's start, TTFT and gaps into --output (as vLLM's "
        "benchmark client's option of that name)",
    )
    parser.add_argument(
        "--procs", type=int, default=1, help="spread the load over this many client processes"
    )
    parser.add_argument(
        "--ramp-s",
        type=float,
        default=0.0,
        help="closed loop: start the workers evenly over this many seconds",
    )
    parser.add_argument(
        "--extra-body",
        default=None,
        metavar="JSON",
        help="fields added to every request's body, e.g. '{\"dry_multiplier\": 0.8}'",
    )


def plot(collected: dict[str, tuple[list[Sample], float]], path: str) -> None:
    """Latency CDFs (TTFT, ITL) and output throughput per target, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for url, (samples, wall) in collected.items():
        ok = [s for s in samples if s.ok]
        for ax, values in (
            (axes[0], sorted(s.ttft_s * 1e3 for s in ok)),
            (axes[1], sorted(x * 1e3 for s in ok for x in s.itl_s)),
        ):
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=url)
        axes[2].bar(url, sum(s.output_tokens for s in ok) / wall if wall else 0.0)
    for ax, title in zip(axes[:2], ("TTFT (ms)", "inter-token latency (ms)"), strict=True):
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests" if "TTFT" in title else "fraction of tokens")
        ax.set_xscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[2].set_ylabel("output tokens/s")
    axes[2].tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Run ``charserve bench`` and print a table."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # A full collection over the modules loaded so far takes tens of ms: the load
    # generator must not add such pauses to the latencies it measures.
    heap.settle()
    # The lean client runs on uvloop, as the gateway does: less of the machine measuring.
    factory = _loop_factory() if args.client == "lean" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        result = runner.run(bench(args))
    keys = [
        "ttft_p50_ms",
        "ttft_p90_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "tpot_p50_ms",
        "e2e_p50_ms",
        "output_tokens_per_s",
        "goodput_requests_per_s",
        "client_cpu_us_per_event",
        "client_cpu_us_per_token",
        "cpu_steal_pct",
        "errors",
    ]
    urls = list(result["targets"])
    print(
        f"{'metric':<22}" + "".join(f"{u:>32}" for u in urls) + ("   ratio" if args.compare else "")
    )
    for k in keys:
        row = f"{k:<22}" + "".join(f"{result['targets'][u].get(k, ''):>32}" for u in urls)
        if args.compare and k in result.get("ratios", {}):
            row += f"   {result['ratios'][k]:.3f}"
        print(row)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))
    return 0 if all(t["errors"] == 0 for t in result["targets"].values()) else 1
