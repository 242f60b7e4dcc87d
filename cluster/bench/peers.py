"""``charserve bench-peers``: charserve against vLLM's own server, one server at a time,
measured by vLLM's benchmark client and by ``charserve bench``.

Per round, each peer in turn is started, warmed, measured at every concurrency by every
client, and stopped, so no two engines ever share the cores:

- ``charserve``: ``charserve up`` (the default config, as ``make run`` serves it);
- ``vllm``: ``python -m vllm.entrypoints.openai.api_server --model M`` with vLLM's own
  defaults: the peer of record, what a user compares with;
- ``vllm-ours``: vLLM's server with charserve's engine settings
  (``python -m workers.baselines.vllm_server``), a second line.

The workload is vLLM's ``random`` dataset (``--input-len`` prompt tokens, ``--output-len``
reply tokens with ``ignore_eos``) for vLLM's client, GuideLLM's ``synthetic_text`` of the
same sizes (``--clients ... guidellm``), and ``charserve bench`` with the same reply
length. Every run's JSON is kept in ``--out``; the table gives each figure's median
over rounds and its ratio to ``vllm`` measured by the same client.

On this machine vLLM's default ``gpu_memory_utilization`` (0.92 of the CPU's NUMA node)
is more than is free once vLLM has loaded, and it refuses to start; ``--vllm-memory``
(0.85) sizes only its KV cache, and is passed to both vLLM peers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import structlog

from cluster.runtime.bundled_model import resolve_model

log = structlog.get_logger(__name__)

SERVED = "smollm2-135m-instruct"
FIGURES = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "tok_s")


@dataclass(frozen=True, slots=True)
class Peer:
    """A server to measure: how to start it, where it answers, and its model name."""

    name: str
    command: list[str]
    port: int
    ready_path: str
    model: str
    env: dict[str, str]


def peers(args: argparse.Namespace, model_path: str) -> dict[str, Peer]:
    """Every peer this run may start."""
    py = sys.executable
    memory = ["--gpu-memory-utilization", str(args.vllm_memory)]
    return {
        "charserve": Peer(
            "charserve",
            [str(Path(py).with_name("charserve")), "up"],
            8000,
            "/ready",
            SERVED,
            {"CHARSERVE_DATA_DIR": str(Path(args.out) / "charserve-data")},
        ),
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
            ],
            8100,
            "/v1/models",
            model_path,
            {},
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
    peer: Peer, tokenizer: str, concurrency: int, prompts: int, args: argparse.Namespace, out: Path
) -> list[str]:
    return [
        sys.executable, "-m", "workers.baselines.vllm_bench",
        "--backend", "openai-chat",
        "--base-url", f"http://127.0.0.1:{peer.port}",
        "--endpoint", "/v1/chat/completions",
        "--model", peer.model,
        "--tokenizer", tokenizer,
        "--dataset-name", "random",
        "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len),
        "--ignore-eos",
        "--num-prompts", str(prompts),
        "--max-concurrency", str(concurrency),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip


def _our_client(
    peer: Peer, concurrency: int, requests: int, args: argparse.Namespace, out: Path
) -> list[str]:
    return [
        str(Path(sys.executable).with_name("charserve")), "bench",
        "--base-url", f"http://127.0.0.1:{peer.port}",
        "--model", peer.model,
        "--concurrency", str(concurrency),
        "--requests", str(requests),
        "--rounds", "1", "--warmup", "4",
        "--max-tokens", str(args.output_len),
        "--output", str(out),
    ]  # fmt: skip


def _guidellm_client(
    peer: Peer, tokenizer: str, concurrency: int, prompts: int, args: argparse.Namespace, out: Path
) -> list[str]:
    return [
        args.guidellm, "run",
        "--backend", f"kind=openai_http,target=http://127.0.0.1:{peer.port},model={peer.model}",
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
    """The figures of one ``vllm bench serve`` result file."""
    d = json.loads(path.read_text())
    return {
        "ttft_p50": d["median_ttft_ms"],
        "ttft_p99": d["p99_ttft_ms"],
        "itl_p50": d["median_itl_ms"],
        "itl_p99": d["p99_itl_ms"],
        "tok_s": d["output_throughput"],
        "failed": d.get("num_prompts", d["completed"]) - d["completed"],
    }


def read_ours(path: Path) -> dict[str, float]:
    """The figures of one ``charserve bench`` report."""
    t = next(iter(json.loads(path.read_text())["targets"].values()))
    return {
        "ttft_p50": t["ttft_p50_ms"],
        "ttft_p99": t["ttft_p99_ms"],
        "itl_p50": t["itl_p50_ms"],
        "itl_p99": t["itl_p99_ms"],
        "tok_s": t["output_tokens_per_s"],
        "failed": t["errors"],
    }


READERS = {"vllm": read_vllm, "charserve": read_ours, "guidellm": read_guidellm}


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run every round; one row per (round, peer, client, concurrency)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(None)
    known = peers(args, model_path)
    rows: list[dict[str, Any]] = []
    for r in range(1, args.rounds + 1):
        for name in args.peers:
            peer = known[name]
            logfile = (out / f"{name}-server-{r}.log").open("wb")
            process = subprocess.Popen(
                peer.command,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                env={**os.environ, **peer.env},
                start_new_session=True,
            )
            try:
                _wait_ready(f"http://127.0.0.1:{peer.port}{peer.ready_path}", process, 600)
                log.info("peer up", peer=name, round=r)
                warm = out / f"{name}-warmup-{r}.json"
                subprocess.run(
                    _vllm_client(peer, model_path, 1, 4, args, warm),
                    check=True,
                    capture_output=True,
                )
                for concurrency, prompts in zip(args.concurrency, args.prompts, strict=True):
                    for client in args.clients:
                        path = out / f"{name}-{client}-c{concurrency}-{r}.json"
                        if client == "vllm":
                            cmd = _vllm_client(peer, model_path, concurrency, prompts, args, path)
                        elif client == "guidellm":
                            cmd = _guidellm_client(
                                peer, model_path, concurrency, prompts, args, path
                            )
                        else:
                            cmd = _our_client(peer, concurrency, prompts, args, path)
                        done = subprocess.run(cmd, capture_output=True, text=True)
                        (out / f"{path.stem}.txt").write_text(done.stdout + done.stderr)
                        if done.returncode != 0:
                            log.warning("client failed", peer=name, client=client, path=str(path))
                            continue
                        figures = READERS[client](path)
                        rows.append(
                            {"round": r, "peer": name, "client": client, "c": concurrency,
                             **figures}
                        )  # fmt: skip
            finally:
                _stop(process)
                logfile.close()
            time.sleep(5)  # the engine's memory returns to the machine
    return rows


def table(rows: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """Medians over rounds, and each figure's ratio to ``vllm`` by the same client."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["client"], row["peer"], row["c"]), []).append(row)
    medians = {
        key: {f: statistics.median(r[f] for r in rs) for f in (*FIGURES, "failed")}
        for key, rs in groups.items()
    }
    lines = [
        f"{'client':<9} {'c':>3} {'peer':<10} "
        + " ".join(f"{f:>14}" for f in FIGURES)
        + f" {'failed':>6} {'runs':>4}"
    ]
    summary: dict[str, Any] = {}
    for (client, peer, c), m in sorted(medians.items()):
        ref = medians.get((client, "vllm", c))
        cells = []
        for f in FIGURES:
            ratio = f" ({m[f] / ref[f]:.2f}x)" if ref and ref[f] and peer != "vllm" else ""
            cells.append(f"{m[f]:>7.1f}{ratio:>7}")
        lines.append(
            f"{client:<9} {c:>3} {peer:<10} "
            + " ".join(f"{cell:>14}" for cell in cells)
            + f" {m['failed']:>6.0f} {len(groups[(client, peer, c)]):>4}"
        )
        summary[f"{client}/{peer}/c{c}"] = {
            **m,
            **(
                {f"{f}_over_vllm": round(m[f] / ref[f], 3) for f in FIGURES if ref[f]}
                if ref and peer != "vllm"
                else {}
            ),
        }
    return "\n".join(lines), summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``charserve bench-peers``."""
    parser.add_argument(
        "--peers",
        nargs="+",
        default=["vllm", "charserve"],
        choices=["charserve", "vllm", "vllm-ours"],
    )
    parser.add_argument("--clients", nargs="+", default=["vllm", "charserve"],
                        choices=["vllm", "charserve", "guidellm"])  # fmt: skip
    parser.add_argument(
        "--guidellm",
        default="guidellm",
        help="GuideLLM's command, for --clients guidellm (install it in a venv of its own: "
        "its dependencies differ from vLLM's)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument(
        "--prompts", type=int, nargs="+", default=[24, 160], help="per concurrency, in order"
    )
    parser.add_argument("--input-len", type=int, default=50)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vllm-memory", type=float, default=0.85)
    parser.add_argument("--out", default="bench-peers", help="every run's result files")


def run(args: argparse.Namespace) -> int:
    """Measure, print the table, write ``summary.json`` into ``--out``."""
    if len(args.concurrency) != len(args.prompts):
        raise SystemExit("--prompts gives one count per --concurrency")
    rows = measure(args)
    text, summary = table(rows)
    Path(args.out, "summary.json").write_text(
        json.dumps({"rows": rows, "summary": summary}, indent=2)
    )
    print(text)
    return 0
