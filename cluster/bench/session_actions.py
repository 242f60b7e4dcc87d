"""``charserve bench-sessions --actions``: what the session actions buy, side by side in one
run on one stack.

- **Swipe**: TTFT of a swipe against TTFT of the reply it replaces (same sessions, the
  swipe right after the reply). A swipe asks the reply's own prompt, so it should find all
  of it in the prefix cache.
- **Warm**: TTFT of a turn whose history the engine has never seen, with and without a
  ``POST /v1/sessions/{id}/warm`` before it. Each session first holds a few turns, then
  every message is edited (same length, new words), so its history is as long as before
  and cached nowhere; half the sessions are then warmed, and all take their next turn.
- **Layout**: the cached share of prompt tokens, per turn, in sessions whose lorebook
  entries trigger differently every turn, on ``--url`` (the gateway's layout, ``stable``
  by default) and on ``--layout-compare`` (a second gateway on the same Redis and workers
  started with ``CHARSERVE_PROMPT_LAYOUT=frontend``), sessions alternating between them.

Every turn streams with ``ignore_eos`` and temperature 0, like the other benchmarks.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from typing import Any

import httpx

from cluster.bench.samples import Sample, percentile
from cluster.bench.sessions import persona_card, session_request

# A lorebook whose entries trigger on one keyword each; the turns name them in rotation
# (the book scans only the latest message), so the triggered set changes every turn.
_LORE_KEYS = ["storm", "harbour", "engine", "map"]


def lore_card(index: int) -> dict[str, Any]:
    """:func:`persona_card` with four keyword-triggered lorebook entries."""
    card = persona_card(index)
    card["data"]["character_book"] = {
        "scan_depth": 1,
        "entries": [
            {
                "keys": [key],
                "content": f"[Lore: the {key} of airship {index}. "
                + f"Details of the {key}. " * 12,
                "enabled": True,
                "insertion_order": n,
                "position": "after_char",
            }
            for n, key in enumerate(_LORE_KEYS)
        ],
    }
    return card


async def _sessions(client: httpx.AsyncClient, url: str, card: dict[str, Any], n: int) -> list[str]:
    character = (await client.post(f"{url}/v1/characters", json=card)).raise_for_status().json()
    out = []
    for j in range(n):
        resp = await client.post(
            f"{url}/v1/sessions", json={"character_id": character["id"], "user_name": f"u{j}"}
        )
        out.append(resp.raise_for_status().json()["id"])
    return out


def _ttft_ms(samples: list[Sample]) -> dict[str, float]:
    ttft = [s.ttft_s * 1000 for s in samples if s.ok]
    return {
        "n": len(ttft),
        "errors": sum(1 for s in samples if not s.ok),
        "ttft_p50_ms": round(percentile(ttft, 50), 1),
        "ttft_p90_ms": round(percentile(ttft, 90), 1),
    }


async def swipes(client: httpx.AsyncClient, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """A reply, then a swipe of it, in each of ``--sessions`` sessions (one at a time, so
    the two are timed on the same idle stack)."""
    url = args.url
    sessions = await _sessions(client, url, persona_card(seed), args.sessions)
    firsts, swiped = [], []
    for j, sid in enumerate(sessions):
        firsts.append(
            await session_request(client, url, args, sid, f"(#{seed}.{j}) What now, captain?")
        )
        swiped.append(await session_request(client, url, args, sid, action="swipe"))
    return {"first_reply": _ttft_ms(firsts), "swipe": _ttft_ms(swiped)}


async def warms(client: httpx.AsyncClient, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Sessions with a history the engine never saw; half warmed before their turn."""
    url = args.url
    sessions = await _sessions(client, url, persona_card(seed + 1), 2 * args.sessions)
    rng = random.Random(seed)
    for j, sid in enumerate(sessions):
        for t in range(args.warm_history_turns):
            await session_request(
                client, url, args, sid, f"(#{seed}.{j}.{t}) Tell me about the sky."
            )
    # Same length, new words: as long a history as before, and in no cache.
    for sid in sessions:
        messages = (await client.get(f"{url}/v1/sessions/{sid}")).raise_for_status().json()
        for i, message in enumerate(messages["messages"]):
            words = message["content"].split()
            rng.shuffle(words)
            text = " ".join(f"{w}{rng.randrange(100)}" for w in words)
            await client.patch(f"{url}/v1/sessions/{sid}/messages/{i}", json={"content": text})
    warmed, cold = sessions[0::2], sessions[1::2]
    for sid in warmed:
        (await client.post(f"{url}/v1/sessions/{sid}/warm")).raise_for_status()
    await asyncio.sleep(args.warm_pause_s)  # the user types
    after_warm, without = [], []
    for j, (a, b) in enumerate(zip(warmed, cold, strict=True)):
        after_warm.append(await session_request(client, url, args, a, f"(#{seed}.{j}) And now?"))
        without.append(await session_request(client, url, args, b, f"(#{seed}.{j}) And now?"))
    return {
        "warmed": _ttft_ms(after_warm),
        "not_warmed": _ttft_ms(without),
        "prompt_tokens_mean": round(
            sum(s.prompt_tokens for s in after_warm + without) / max(len(sessions), 1)
        ),
    }


async def layouts(client: httpx.AsyncClient, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The cached share per turn with lorebook triggers changing every turn, on each
    gateway's layout; sessions alternate between the gateways turn by turn."""
    targets = {"stable": args.url, "frontend": args.layout_compare}
    shares: dict[str, list[list[float]]] = {k: [] for k, u in targets.items() if u}
    sessions = {
        k: await _sessions(client, u, lore_card(seed + 2), args.sessions)
        for k, u in targets.items()
        if u
    }
    per_turn: dict[str, list[list[float]]] = {k: [[] for _ in range(args.turns)] for k in shares}
    for j in range(args.sessions):
        for t in range(args.turns):
            key = _LORE_KEYS[t % len(_LORE_KEYS)]
            for label in shares:
                text = f"(#{seed}.{j}.{t}) What about the {key}?"
                sample = await session_request(
                    client, targets[label], args, sessions[label][j], text
                )
                if sample.ok and sample.prompt_tokens:
                    per_turn[label][t].append(sample.cached_tokens / sample.prompt_tokens)
    out: dict[str, Any] = {}
    for label, turns in per_turn.items():
        means = [round(sum(v) / len(v), 3) if v else 0.0 for v in turns]
        later = [x for v in turns[1:] for x in v]
        out[label] = {
            "cached_share_by_turn": means,
            "cached_share_turns_2plus": round(sum(later) / len(later), 3) if later else 0.0,
        }
    return out


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    """All three comparisons, in one run on one stack."""
    seed = random.randrange(1_000_000)
    limits = httpx.Limits(max_connections=50)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        report: dict[str, Any] = {"swipe": await swipes(client, args, seed)}
        report["warm"] = await warms(client, args, seed)
        report["layout"] = await layouts(client, args, seed)
    swipe, warm = report["swipe"], report["warm"]
    if swipe["first_reply"]["ttft_p50_ms"]:
        report["ratio_swipe_over_first_ttft_p50"] = round(
            swipe["swipe"]["ttft_p50_ms"] / swipe["first_reply"]["ttft_p50_ms"], 3
        )
    if warm["not_warmed"]["ttft_p50_ms"]:
        report["ratio_warmed_over_not_ttft_p50"] = round(
            warm["warmed"]["ttft_p50_ms"] / warm["not_warmed"]["ttft_p50_ms"], 3
        )
    report["settings"] = {
        k: getattr(args, k)
        for k in ("sessions", "turns", "max_tokens", "priority", "warm_history_turns")
    }
    return report


def table(report: dict[str, Any]) -> str:
    """The report as the lines ``charserve bench-sessions --actions`` prints."""
    swipe, warm, layout = report["swipe"], report["warm"], report["layout"]
    lines = [
        f"swipe TTFT p50 {swipe['swipe']['ttft_p50_ms']:.1f} ms vs first reply "
        f"{swipe['first_reply']['ttft_p50_ms']:.1f} ms: "
        f"{report.get('ratio_swipe_over_first_ttft_p50')}",
        f"turn after warm TTFT p50 {warm['warmed']['ttft_p50_ms']:.1f} ms vs not warmed "
        f"{warm['not_warmed']['ttft_p50_ms']:.1f} ms: "
        f"{report.get('ratio_warmed_over_not_ttft_p50')} "
        f"(~{warm['prompt_tokens_mean']} prompt tokens)",
    ]
    for label, row in layout.items():
        lines.append(
            f"layout {label:<8} cached share, turns 2+: {row['cached_share_turns_2plus']:.3f} "
            f"by turn {row['cached_share_by_turn']}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options only ``--actions`` reads."""
    parser.add_argument(
        "--actions",
        action="store_true",
        help="measure swipe, warm and the prompt layout instead of affinity",
    )
    parser.add_argument(
        "--layout-compare",
        default=None,
        help="a gateway started with CHARSERVE_PROMPT_LAYOUT=frontend (same Redis, workers)",
    )
    parser.add_argument("--warm-history-turns", type=int, default=6)
    parser.add_argument("--warm-pause-s", type=float, default=2.0)
