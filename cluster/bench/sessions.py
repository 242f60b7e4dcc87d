"""``charserve bench-sessions``: multi-turn character sessions, with replica affinity
against without it.

Each round creates a few characters (long personas, shared by several users) and
``--sessions`` sessions, then runs every session's ``--turns`` turns concurrently, each turn
waiting for the previous reply as a user would. It measures TTFT of turns 2..N (the turns
whose history is already in some replica's prefix cache) and the prefix-cache hit rate two
ways: from each reply's ``usage.prompt_tokens_details.cached_tokens``, and from vLLM's own
``vllm:prefix_cache_hits_total`` / ``_queries_total`` counters on ``/metrics``.

Give it two gateways on the same Redis and workers, ``--url`` with
``CHARSERVE_SESSION_AFFINITY=true`` and ``--compare`` with ``false``; rounds alternate
between them, so both see the same machine, workers and caches.

``--actions`` measures the session actions instead (:mod:`cluster.bench.session_actions`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx
import structlog
from prometheus_client.parser import text_string_to_metric_families

from cluster.bench.load import USER_PROMPTS, one_request
from cluster.bench.samples import Sample, percentile

_TRAITS = [
    "keeps a brass compass from a mother who vanished at sea",
    "collects forbidden maps and trades them for favours",
    "speaks to the ship as if it were alive and listens for its answer",
    "never forgets a debt, and never lets one go unpaid",
    "hums old harbour songs when nervous and jokes when afraid",
    "has survived three mutinies by being kinder than the mutineers",
]


def persona_card(index: int) -> dict[str, Any]:
    """A character with a long persona (a few hundred tokens), distinct per ``index``."""
    rng = random.Random(index)
    traits = ". ".join(rng.sample(_TRAITS, k=len(_TRAITS)))
    return {
        "spec": "chara_card_v2",
        "spec_version": "2.0",
        "data": {
            "name": f"Captain No. {index}",
            "description": (
                f"{{{{char}}}} commands airship number {index} of the free cloud fleet. "
                f"{traits}. {{{{char}}}} treats {{{{user}}}} as a trusted deckhand, answers in "
                "a few vivid sentences, and always steers the story toward the next storm, "
                "the next port or the next mystery in the sky. " * 2
            ),
            "personality": "bold, warm, teasing, stubborn, loyal to the crew",
            "scenario": "The ship is two days from port and the barometer is falling.",
            "first_mes": "There you are, {{user}}! Grab a rope.",
            "mes_example": "<START>\n{{user}}: Hello\n{{char}}: Ahoy, deckhand!",
        },
    }


async def session_request(
    client: httpx.AsyncClient,
    url: str,
    args: argparse.Namespace,
    session_id: str,
    text: str = "",
    action: str = "reply",
) -> Sample:
    """One streamed session request: a turn with the user's ``text``, or (``action``)
    a swipe, continue or impersonate of the session, which takes no message."""
    return await one_request(
        client,
        url,
        args.model,
        args.max_tokens,
        "",
        headers={"X-Priority": args.priority},
        messages=[{"role": "user", "content": text}] if action == "reply" else [],
        extra={"session_id": session_id, "session_action": action},
    )


async def _vllm_cache_counters(client: httpx.AsyncClient, url: str) -> tuple[float, float]:
    """Sum of vLLM's prefix-cache hits and queries over every replica."""
    text = (await client.get(f"{url}/metrics")).text
    hits = queries = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:prefix_cache_hits_total":
                hits += sample.value
            elif sample.name == "vllm:prefix_cache_queries_total":
                queries += sample.value
    return hits, queries


async def _round(url: str, args: argparse.Namespace, seed: int) -> list[tuple[int, Sample]]:
    """One round on one gateway: (turn index, sample) for every turn of every session."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        characters = []
        for i in range(args.characters):
            resp = await client.post(f"{url}/v1/characters", json=persona_card(i))
            resp.raise_for_status()
            characters.append(resp.json()["id"])
        sessions = []
        for j in range(args.sessions):
            resp = await client.post(
                f"{url}/v1/sessions",
                json={"character_id": characters[j % len(characters)], "user_name": f"u{j}"},
            )
            resp.raise_for_status()
            sessions.append(resp.json()["id"])

        async def converse(j: int, session_id: str) -> list[tuple[int, Sample]]:
            out = []
            for turn in range(args.turns):
                text = f"(#{seed}.{j}.{turn}) {rng.choice(USER_PROMPTS)}"
                sample = await session_request(client, url, args, session_id, text)
                out.append((turn, sample))
            return out

        results = await asyncio.gather(*(converse(j, s) for j, s in enumerate(sessions)))
        for session_id in sessions:
            await client.delete(f"{url}/v1/sessions/{session_id}")
        for character_id in characters:
            await client.delete(f"{url}/v1/characters/{character_id}")
    return [pair for session in results for pair in session]


def _summary(turns: list[tuple[int, Sample]], hits: float, queries: float) -> dict[str, Any]:
    later = [s for t, s in turns if t >= 1 and s.ok]
    ttft = [s.ttft_s * 1000 for s in later]
    prompt = sum(s.prompt_tokens for s in later)
    return {
        "turns": len(turns),
        "errors": sum(1 for _, s in turns if not s.ok),
        "ttft_p50_ms_turns_2plus": round(percentile(ttft, 50), 1),
        "ttft_p90_ms_turns_2plus": round(percentile(ttft, 90), 1),
        "cached_fraction_turns_2plus": round(
            sum(s.cached_tokens for s in later) / prompt if prompt else 0.0, 3
        ),
        "vllm_prefix_cache_hit_rate": round(hits / queries if queries else 0.0, 3),
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Alternate rounds between the affinity and the no-affinity gateway."""
    targets = {"affinity": args.url, "no_affinity": args.compare}
    collected: dict[str, list[tuple[int, Sample]]] = {k: [] for k in targets}
    cache: dict[str, list[float]] = {k: [0.0, 0.0] for k in targets}
    async with httpx.AsyncClient(timeout=30) as probe:
        for r in range(args.rounds):
            for label, url in targets.items():
                if not url:
                    continue
                before = await _vllm_cache_counters(probe, url)
                started = time.perf_counter()
                collected[label].extend(await _round(url, args, seed=1000 * r + len(label)))
                # Workers export their metrics every few seconds: wait for this round's.
                await asyncio.sleep(args.metrics_wait_s)
                after = await _vllm_cache_counters(probe, url)
                cache[label][0] += after[0] - before[0]
                cache[label][1] += after[1] - before[1]
                structlog.get_logger(__name__).info(
                    "round done", label=label, round=r, s=round(time.perf_counter() - started)
                )
    report = {
        label: _summary(collected[label], *cache[label]) for label in targets if targets[label]
    }
    if "no_affinity" in report:
        a, b = report["affinity"], report["no_affinity"]
        report["ratio_ttft_p50_affinity_over_none"] = round(
            a["ttft_p50_ms_turns_2plus"] / b["ttft_p50_ms_turns_2plus"], 3
        )
    report["settings"] = {
        k: getattr(args, k)
        for k in ("sessions", "turns", "characters", "max_tokens", "rounds", "priority")
    }
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``charserve bench-sessions``."""
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="affinity gateway")
    parser.add_argument("--compare", default=None, help="gateway without affinity")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--characters", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument(
        "--priority",
        default="standard",
        help="X-Priority of the turns (standard: a 30 s budget, so a loaded 2-core machine "
        "measures placement rather than refusals)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--metrics-wait-s", type=float, default=7.0)
    parser.add_argument("--json", default="bench-sessions.json", help="write the report here")
    from cluster.bench import session_actions  # it imports this module

    session_actions.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print a table, write the JSON report."""
    if args.actions:
        from cluster.bench import session_actions

        report = asyncio.run(session_actions.bench(args))
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(session_actions.table(report))
        return 0
    report = asyncio.run(bench(args))
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    rows = [k for k in ("affinity", "no_affinity") if k in report]
    header = (
        f"{'gateway':<12} {'turns':>5} {'err':>4} {'TTFT p50 t2+':>13} {'p90':>8} "
        f"{'cached/prompt':>14} {'vLLM hit rate':>14}"
    )
    lines = [header]
    for k in rows:
        r = report[k]
        lines.append(
            f"{k:<12} {r['turns']:>5} {r['errors']:>4} {r['ttft_p50_ms_turns_2plus']:>10.1f} ms "
            f"{r['ttft_p90_ms_turns_2plus']:>6.0f} ms {r['cached_fraction_turns_2plus']:>14.3f} "
            f"{r['vllm_prefix_cache_hit_rate']:>14.3f}"
        )
    if "ratio_ttft_p50_affinity_over_none" in report:
        lines.append(
            f"TTFT p50 (turns 2+) affinity/none: {report['ratio_ttft_p50_affinity_over_none']}"
        )
    print("\n".join(lines))
    return 0
