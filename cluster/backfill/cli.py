"""``charserve backfill`` and ``python -m cluster.backfill``: the command line of
:mod:`cluster.backfill.driver` (its docstring describes the input and output)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

import httpx

from cluster.backfill.driver import Options, backfill
from cluster.backfill.plan import DEFAULT_SYSTEM_PROMPT
from cluster.wire.vocabulary import PriorityClass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``charserve backfill``."""
    parser.add_argument("input", help="dialogues to generate (JSONL, one per line)")
    parser.add_argument("-o", "--output", required=True, help="output JSONL (appended to)")
    parser.add_argument("--errors", default=None, help="errors JSONL (OUTPUT.errors.jsonl)")
    parser.add_argument(
        "--base-url", default=os.environ.get("CHARSERVE_BASE_URL", "http://127.0.0.1:8000")
    )
    parser.add_argument("--api-key", default=os.environ.get("CHARSERVE_API_KEY"))
    parser.add_argument("--model", default=None, help="default: the gateway's first model")
    parser.add_argument("--concurrency", type=int, default=32, help="dialogues in flight")
    parser.add_argument("--max-tokens", type=int, default=128, help="per character turn")
    parser.add_argument("--user-max-tokens", type=int, default=64, help="per user turn")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument(
        "--priority", default=PriorityClass.BATCH, choices=[c.value for c in PriorityClass]
    )
    parser.add_argument("--format", default="openai", choices=("openai", "sharegpt"))
    parser.add_argument("--system-prompt", default=DEFAULT_SYSTEM_PROMPT)
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per request")
    parser.add_argument("--max-retries", type=int, default=30, help="per request, on 429/503")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def options_from(args: argparse.Namespace) -> Options:
    """The run's options from parsed arguments."""
    return Options(
        base_url=args.base_url.rstrip("/"),
        api_key=args.api_key,
        model=args.model,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        user_max_tokens=args.user_max_tokens,
        temperature=args.temperature,
        priority=args.priority,
        format=args.format,
        system_prompt=args.system_prompt,
        timeout_s=args.timeout_s,
        max_retries=args.max_retries,
        progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    """Run ``charserve backfill``; 0 when every dialogue is done, 1 if some failed."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        report = asyncio.run(
            backfill(
                Path(args.input),
                Path(args.output),
                options_from(args),
                Path(args.errors) if args.errors else None,
            )
        )
    except (OSError, httpx.HTTPError) as exc:
        sys.stderr.write(f"charserve backfill: {exc}\n")
        return 2
    sys.stderr.write(
        f"{report.completed} dialogues written, {report.skipped} already done, "
        f"{report.failed} failed; {report.requests} requests, "
        f"{report.completion_tokens} tokens in {report.elapsed_s:.1f} s "
        f"({report.completion_tokens_per_s:.1f} tok/s)\n"
    )
    return 1 if report.failed else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m cluster.backfill`` (what ``charserve backfill`` runs)."""
    from cluster.backfill import driver

    parser = argparse.ArgumentParser(prog="backfill", description=driver.__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_arguments(parser)
    return run(parser.parse_args(argv))
