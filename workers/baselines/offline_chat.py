"""vLLM's offline ``LLM.chat`` on the same dialogues as a backfill: the throughput baseline.

``python -m workers.baselines.offline_chat --plans PLANS.jsonl`` loads the engine with exactly
the settings of a Serve config (``--config``, as :mod:`workers.baselines.vllm_server` does),
then plays every dialogue of ``PLANS.jsonl`` (written by :mod:`cluster.bench.backfill`
from the same input as the backfill) turn by turn: each round is one ``LLM.chat`` call with
the next prompt of every unfinished dialogue, so vLLM batches them as it likes. Prompts,
sampling and turn order come from :mod:`cluster.backfill.driver`, so both runs generate the same
dialogues (per-request seeds only with ``--seeds``: see its help). It prints one JSON
object: tokens, requests and wall time (model loading excluded).

For benchmarks only, never in tests, and never while another engine runs on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from cluster.backfill.plan import (
    Message,
    Plan,
    finished,
    first_history,
    next_cut,
    next_speaker,
    prompt_for,
    request_seed,
)
from cluster.runtime.bundled_model import resolve_model
from workers.baselines.vllm_server import engine_config_from


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Play every dialogue; the measurements."""
    config = engine_config_from(args.config)
    os.environ.update(config.env())
    from vllm import LLM, SamplingParams

    model = resolve_model(config.model or os.environ.get("CHARSERVE_MODEL"))
    kwargs = config.engine_kwargs(model)
    llm = LLM(**kwargs)
    tokenizer: Any = llm.get_tokenizer()
    plans = [
        Plan.from_json(json.loads(raw))
        for raw in Path(args.plans).read_text().splitlines()
        if raw.strip()
    ]

    def fit(plan: Plan, history: list[Message], max_tokens: int) -> list[Message]:
        """The prompt, with the oldest exchanges left out until it fits (as the backfill
        does when the gateway says it does not)."""
        start: int | None = 0
        while start is not None:
            prompt = prompt_for(plan, history, start)
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            if len(ids) + max_tokens <= config.max_model_len:
                return prompt
            start = next_cut(history, start)
        raise ValueError(f"dialogue {plan.spec.id} cannot fit the context window")

    histories = [first_history(p) for p in plans]
    turns = [0] * len(plans)
    completion_tokens = prompt_tokens = requests = 0
    started = time.perf_counter()
    while True:
        active = [i for i, p in enumerate(plans) if not finished(histories[i], p)]
        if not active:
            break
        prompts: list[list[Message]] = []
        params = []
        for i in active:
            plan, history = plans[i], histories[i]
            character = next_speaker(history) == "assistant"
            max_tokens = (
                (plan.spec.max_tokens or args.max_tokens) if character else args.user_max_tokens
            )
            temperature = (
                plan.spec.temperature if plan.spec.temperature is not None else args.temperature
            )
            prompts.append(fit(plan, history, max_tokens))
            params.append(
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=temperature,
                    seed=request_seed(plan.spec, turns[i]) if args.seeds else None,
                    ignore_eos=args.ignore_eos,
                )
            )
        outputs = llm.chat(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
        for i, out in zip(active, outputs, strict=True):
            completion = out.outputs[0]
            histories[i].append(
                {"role": next_speaker(histories[i]), "content": completion.text.strip()}
            )
            turns[i] += 1
            completion_tokens += len(completion.token_ids)
            prompt_tokens += len(out.prompt_token_ids or [])
            requests += 1
    elapsed_s = time.perf_counter() - started
    return {
        "dialogues": len(plans),
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "elapsed_s": round(elapsed_s, 2),
        "completion_tokens_per_s": round(completion_tokens / elapsed_s, 1),
    }


def main() -> None:
    """Print the measurements as one JSON line on stdout."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", required=True)
    parser.add_argument("--config", default="ray-configs/local-cpu.yaml")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--user-max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument(
        "--seeds",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="per-request seeds as the backfill sends them. Off by default: vLLM's CPU "
        "build dies ('CPU Generator does not use offset') when a seeded prompt's prefill "
        "is chunked, which a whole batch of prompts at once triggers; with --ignore-eos "
        "the work is the same either way",
    )
    result = run(parser.parse_args())
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
