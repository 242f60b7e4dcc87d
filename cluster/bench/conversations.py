"""Multi-turn persona conversations against any OpenAI-compatible chat endpoint: the
long-prompt client of ``charserve bench-peers --workload persona``.

Roleplay traffic is long prompts that share prefixes: a character's persona (about 900
tokens) shared by many users, then each user's own history. ``--concurrency``
conversations run at once, each of ``--turns`` turns in sequence; a turn sends the full
message list (persona as the system prompt, every earlier turn with its real reply, and a
new short user message) to ``/v1/chat/completions``, as a roleplay frontend does, so it
works alike against vLLM's own server and charserve (no charserve session API). Turns 2
and later find the persona and their own history in the prefix cache: their TTFT is the
figure of record, reported apart from turn 1's.

Requests carry no priority header unless a ``--header`` names one (a user of vLLM sends
none; vLLM's server ignores it); charserve's refusals (HTTP 429) are counted apart from
other errors. Personas are built deterministically from ``--seed``, so every server and
round gets the same text.

Run as ``python -m cluster.bench.conversations --base-url URL --output report.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from cluster.bench.load import USER_PROMPTS, add_header_argument, one_request, parse_headers
from cluster.bench.samples import Sample, percentile

# Characters per token of the persona prose for SmolLM2's tokenizer (measured on the text
# below: tests/cluster/test_bench_peers.py checks the resulting length).
CHARS_PER_TOKEN = 4.55

_NAMES = ["Mira", "Tobias", "Selene", "Rook", "Isolde", "Caspian", "Wren", "Dorian"]
_ROLES = [
    "airship captain", "court alchemist", "border ranger", "retired duellist",
    "lighthouse keeper", "travelling archivist", "smuggler queen", "oracle's apprentice",
]  # fmt: skip
_PLACES = [
    "the salt cliffs of Varn", "a drowned city in the south", "the glass monastery",
    "the frontier town of Ashford", "the floating markets", "a mountain observatory",
]  # fmt: skip
_TRAITS = [
    "keeps a brass compass from a mother who vanished at sea",
    "collects forbidden maps and trades them for favours",
    "speaks to machines as if they were alive and waits for their answer",
    "never forgets a debt, and never lets one go unpaid",
    "hums old harbour songs when nervous and makes jokes when afraid",
    "has survived three mutinies by being kinder than the mutineers",
    "distrusts anyone who smiles too quickly",
    "writes letters to a brother who has not answered in ten years",
    "can name every star visible from the northern sea",
    "refuses to carry a weapon but wins most fights anyway",
    "bakes bread at dawn because it is the only quiet hour",
    "owes a dangerous favour to a merchant prince",
]
_HABITS = [
    "answers questions with questions when cornered",
    "describes the weather before anything else",
    "uses nautical words even on dry land",
    "lowers their voice when telling the truth",
    "taps two fingers on the table while thinking",
    "gives everyone a nickname within an hour of meeting them",
]
_RULES = [
    "Stay in character at all times and speak in the first person.",
    "Describe actions between asterisks and keep dialogue vivid and short.",
    "Never decide what {user} does or feels; leave room for their reply.",
    "Move the story forward with a new detail, danger or secret in every reply.",
    "Remember what {user} said earlier and bring it back when it matters.",
]


def persona_text(index: int, tokens: int, seed: int = 0) -> str:
    """The system prompt of character ``index``: a persona of about ``tokens`` tokens,
    the same text for the same arguments."""
    rng = random.Random(seed * 1_000_003 + index)
    name = f"{rng.choice(_NAMES)} of {rng.choice(_PLACES)}"
    parts = [
        f"You are {name}, the {rng.choice(_ROLES)} (character {seed}.{index}). "
        + " ".join(r.format(user="the user") for r in _RULES)
    ]
    # Stop within half a sentence (about 60 characters) of the target, either side.
    target_chars = tokens * CHARS_PER_TOKEN - 60
    size = len(parts[0])
    while size < target_chars:
        sentence = (
            f"{name.split()[0]} {rng.choice(_TRAITS)}, {rng.choice(_HABITS)}, and once "
            f"spent {rng.randint(2, 40)} days in {rng.choice(_PLACES)} as the "
            f"{rng.choice(_ROLES)}."
        )
        parts.append(sentence)
        size += len(sentence) + 1
    return " ".join(parts)


def user_message(conversation: int, turn: int, rng: random.Random) -> str:
    """A short user turn, distinct per conversation and turn."""
    return f"(#{conversation}.{turn}) {rng.choice(USER_PROMPTS)}"


async def converse(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    system: str,
    turns: int,
    max_tokens: int,
    conversation: int,
    seed: int,
    headers: dict[str, str] | None = None,
) -> list[tuple[int, Sample]]:
    """One conversation: ``turns`` turns in sequence, each sending the whole history plus
    a new user message; a reply joins the history, a failed turn does not."""
    rng = random.Random(seed * 1_000_003 + 7919 * conversation)
    history = [{"role": "system", "content": system}]
    out = []
    for turn in range(turns):
        message = {"role": "user", "content": user_message(conversation, turn, rng)}
        sample = await one_request(
            client, url, model, max_tokens, "", headers, messages=[*history, message]
        )
        out.append((turn, sample))
        if sample.ok:
            history += [message, {"role": "assistant", "content": sample.text}]
    return out


async def run_conversations(
    url: str,
    model: str,
    concurrency: int,
    turns: int,
    personas: int,
    persona_tokens: int,
    max_tokens: int,
    seed: int,
    headers: dict[str, str] | None = None,
) -> tuple[list[tuple[int, Sample]], float, float]:
    """``concurrency`` conversations at once, conversation ``j`` with persona
    ``j % personas`` (each request with ``headers``): (turn, sample) of every turn, and
    the run's start and end (``time.perf_counter``, the system's monotonic clock)."""
    systems = [persona_text(i, persona_tokens, seed) for i in range(personas)]
    limits = httpx.Limits(max_connections=max(concurrency, 8))
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(
                converse(
                    client, url, model, systems[j % personas], turns, max_tokens, j, seed, headers
                )
                for j in range(concurrency)
            )
        )
        end = time.perf_counter()
    return [pair for conversation in results for pair in conversation], start, end


def summarize(turns: list[tuple[int, Sample]], start_s: float, end_s: float) -> dict[str, Any]:
    """TTFT of turn 1 and of turns 2+ apart (ms), ITL, output tokens/s, errors and
    refusals (HTTP 429, also counted in errors)."""
    ok = [(t, s) for t, s in turns if s.ok]
    later = [s for t, s in ok if t >= 1]
    wall_s = end_s - start_s
    out: dict[str, Any] = {
        "turns": len(turns),
        "errors": len(turns) - len(ok),
        "refused": sum(1 for _, s in turns if s.status == 429),
        "window": {"start_s": start_s, "end_s": end_s},
    }
    for name, values in (
        ("ttft", [s.ttft_s for _, s in ok]),
        ("ttft_first", [s.ttft_s for t, s in ok if t == 0]),
        ("ttft_later", [s.ttft_s for s in later]),
        ("itl", [x for _, s in ok for x in s.itl_s]),
    ):
        for q in (50, 99):
            out[f"{name}_p{q}_ms"] = round(percentile(values, q) * 1000.0, 2)
    tokens = sum(s.output_tokens for _, s in ok)
    out["output_tokens"] = tokens
    out["output_tokens_per_s"] = round(tokens / wall_s, 2) if wall_s > 0 else 0.0
    prompt = sum(s.prompt_tokens for s in later)
    out["prompt_tokens_later_mean"] = round(prompt / len(later), 1) if later else 0.0
    # Servers that report usage.prompt_tokens_details (charserve does; vLLM's server only
    # with --enable-prompt-tokens-details).
    out["cached_fraction_later"] = (
        round(sum(s.cached_tokens for s in later) / prompt, 3) if prompt else 0.0
    )
    failed = [s for _, s in turns if not s.ok]
    if failed:
        out["first_error"] = failed[0].error
    refused = [s for _, s in turns if s.status == 429]
    if refused:
        out["first_refusal"] = refused[0].error
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the conversation client."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, default=8, help="conversations at once")
    parser.add_argument("--turns", type=int, default=8, help="turns per conversation")
    parser.add_argument("--personas", type=int, default=4, help="characters, shared")
    parser.add_argument("--persona-len", type=int, default=900, help="persona tokens")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    add_header_argument(parser)
    parser.add_argument("--output", required=True, help="write the JSON report here")


def main(argv: list[str] | None = None) -> int:
    """Run the conversations and write the report (failed turns are in it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    turns, start_s, end_s = asyncio.run(
        run_conversations(
            args.base_url,
            args.model,
            args.concurrency,
            args.turns,
            args.personas,
            args.persona_len,
            args.max_tokens,
            args.seed,
            parse_headers(args.header),
        )
    )
    report = {
        "workload": {k: v for k, v in vars(args).items() if k != "output"},
        **summarize(turns, start_s, end_s),
    }
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "workload"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
