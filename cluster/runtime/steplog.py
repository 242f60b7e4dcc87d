"""The step log's format: one tab-separated line per engine step that scheduled anything,

``monotonic_s  tokens  new_requests  new_prompt_tokens  requests``

written by an engine core with ``CHARSERVE_STEP_LOG=DIR`` in its environment
(:mod:`workers.engines.steplog`, under charserve's scheduler or vLLM's own server) and
read back by the benchmarks (:mod:`cluster.bench.steps`). The times are the system's
monotonic clock, as both benchmark clients' start times, so a run's window selects its
steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The directory an engine core writes its step log into, one file per process.
STEP_LOG_ENV = "CHARSERVE_STEP_LOG"
FILE_GLOB = "steps-*.tsv"


@dataclass(frozen=True, slots=True)
class Step:
    """One engine step."""

    at_s: float  # when it was scheduled (monotonic)
    tokens: int  # prompt and output tokens it computes
    new: int  # requests it starts (their first prefill chunk)
    new_tokens: int  # those requests' prompt tokens in it
    requests: int  # requests in it


def line(step: Step) -> str:
    """``step`` as one line of a step log."""
    return f"{step.at_s:.6f}\t{step.tokens}\t{step.new}\t{step.new_tokens}\t{step.requests}\n"


def parse(text: str) -> list[Step]:
    """Every complete line of a step log (a line being written is left out)."""
    steps = []
    for row in text.split("\n")[:-1]:
        fields = row.split("\t")
        if len(fields) != 5:
            continue
        steps.append(
            Step(float(fields[0]), int(fields[1]), int(fields[2]), int(fields[3]), int(fields[4]))
        )
    return steps


def read_steps(directory: Path, start_s: float, end_s: float) -> list[Step]:
    """The steps scheduled from ``start_s`` to ``end_s`` in every step log of
    ``directory``, in order."""
    steps = [
        s
        for path in sorted(directory.glob(FILE_GLOB))
        for s in parse(path.read_text())
        if start_s <= s.at_s <= end_s
    ]
    return sorted(steps, key=lambda s: s.at_s)
