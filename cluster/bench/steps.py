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

import bisect
import itertools
import statistics
from collections import Counter

from cluster.bench.samples import percentile
from cluster.runtime.steplog import Step


def summarise(steps: list[Step]) -> dict[str, float | str]:
    """What a run's steps show:

    - ``steps``; ``arrival_steps``, the steps that started requests;
    - ``arrivals``: how many requests each of those started, as ``size×count`` (say
      ``1×6 25×5``: a closed loop's streams reaching the engine in groups);
    - ``stalled_pct``: of the decodes in all steps (a running request's token), the percent
      that shared their step with a starting request's prefill, so waited for it;
    - ``decode_step_ms``: the median time between two steps that started nothing;
    - ``running_mean``: the engine's batch size over the steps' span, each step's requests
      weighted by the time until the next step (exact, where a metrics gauge is sampled).
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
        "decode_step_ms": _median_ms(gaps),
        "running_mean": _running_mean(steps),
    }


def _running_mean(steps: list[Step]) -> float:
    """Requests in the engine, time-weighted over ``steps``' span; NaN for one step."""
    span = steps[-1].at_s - steps[0].at_s
    if span <= 0:
        return float("nan")
    held = sum(a.requests * (b.at_s - a.at_s) for a, b in itertools.pairwise(steps))
    return round(held / span, 1)


def _median_ms(values: list[float]) -> float:
    """The median of ``values`` (milliseconds) to 0.1 ms; NaN when there are none."""
    return round(statistics.median(values), 1) if values else float("nan")


def carries_prompt(step: Step) -> bool:
    """True when ``step`` computed prompt tokens: a decode is one token a request, so a
    step with more tokens than requests prefilled some prompt in it."""
    return step.tokens > step.requests


def step_in_flight(windows: list[tuple[list[Step], list[float]]]) -> dict[str, float]:
    """What requests found the engine doing when they were sent, over ``windows`` (each a
    run's steps and the times its requests were sent, monotonic seconds as the step log's;
    several runs pool their requests, and no step is paired across two runs):

    - ``step_wait_ms_p50`` / ``_p99``: from each request's sending to the next step's
      scheduling, the first step it could be in (an idle engine's next step is the
      request's own, so this is then its hops; a request that reaches the engine a few
      milliseconds after a step is scheduled waits one more, which this does not count);
    - ``in_flight_with_prompts_pct``: the percent of the requests sent while a step that
      carried prompt tokens ran (:func:`carries_prompt`);
    - ``steps_with_prompts_pct``: the percent of the steps that carried prompt tokens, and
      ``prompt_step_ms`` / ``decode_only_step_ms``: the median time from such a step to
      the next, and from a step of decodes alone to the next.

    Empty when no request was sent between two steps.
    """
    waits: list[float] = []
    with_prompts = 0
    gaps: dict[bool, list[float]] = {True: [], False: []}
    for steps, sent_s in windows:
        starts = [s.at_s for s in steps]
        for sent in sent_s:
            index = bisect.bisect_right(starts, sent)
            if 0 < index < len(steps):  # else sent before the first step or after the last
                waits.append(starts[index] - sent)
                with_prompts += carries_prompt(steps[index - 1])
        for a, b in itertools.pairwise(steps):
            gaps[carries_prompt(a)].append((b.at_s - a.at_s) * 1000.0)
    if not waits:
        return {}
    return {
        "step_wait_ms_p50": round(percentile(waits, 50) * 1000.0, 1),
        "step_wait_ms_p99": round(percentile(waits, 99) * 1000.0, 1),
        "in_flight_with_prompts_pct": round(100.0 * with_prompts / len(waits), 1),
        "steps_with_prompts_pct": round(
            100.0 * len(gaps[True]) / (len(gaps[True]) + len(gaps[False])), 1
        ),
        "prompt_step_ms": _median_ms(gaps[True]),
        "decode_only_step_ms": _median_ms(gaps[False]),
    }
