"""The engine's own steps, as a step log records them: what each step of vLLM's scheduler
held, read back over a client's measured window.

A step log (:mod:`cluster.runtime.steplog`: ``CHARSERVE_STEP_LOG=DIR`` in an engine
core's environment, under charserve's scheduler or, with ``--scheduler-cls``, under vLLM's
own server) has a line per step. What it shows that no client can: how a closed loop's
streams reach the engine. When a step's new prompts share it with running decodes, every
one of those decodes waits for the prompts' prefill: those are the long inter-token gaps of
a run, and how many streams arrive together decides how long they are and how many there
are.
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter

from cluster.runtime.steplog import Step


def summarise(steps: list[Step]) -> dict[str, float | str]:
    """What a run's steps show:

    - ``steps``; ``arrival_steps``, the steps that started requests;
    - ``arrivals``: how many requests each of those started, as ``size×count`` (say
      ``1×6 25×5``: a closed loop's streams reaching the engine in groups);
    - ``stalled_pct``: of the decodes in all steps (a running request's token), the percent
      that shared their step with a starting request's prefill, so waited for it;
    - ``decode_step_ms``: the median time between two steps that started nothing.
    """
    if not steps:
        return {}
    arrivals = [s for s in steps if s.new]
    decodes = sum(s.requests - s.new for s in steps)
    stalled = sum(s.requests - s.new for s in arrivals)
    gaps = [(b.at_s - a.at_s) * 1000.0 for a, b in itertools.pairwise(steps) if not a.new]
    sizes = Counter(s.new for s in arrivals)
    return {
        "steps": len(steps),
        "arrival_steps": len(arrivals),
        "arrivals": " ".join(f"{n}×{k}" for n, k in sorted(sizes.items())),
        "stalled_pct": round(100.0 * stalled / decodes, 2) if decodes else 0.0,
        "decode_step_ms": round(statistics.median(gaps), 1) if gaps else float("nan"),
    }
