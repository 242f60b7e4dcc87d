"""Admission: a request's class and latency budget become its deadline.

``X-Priority: interactive|standard|batch`` picks a class (default interactive) and
``X-Latency-Budget-Ms`` overrides the class's TTFT budget. Deadline = arrival + budget; the
queue runs earliest deadline first and a worker drops a job whose deadline has passed.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.settings import Settings
from gateway.errors import BadRequest

CLASSES = ("interactive", "standard", "batch")


@dataclass(frozen=True, slots=True)
class Admission:
    """The admitted class and deadline of one request."""

    priority_class: str
    arrival_ms: int
    deadline_ms: int


def admit(
    settings: Settings, arrival_ms: int, priority: str | None, budget: str | None
) -> Admission:
    """Decide class and deadline from the request headers; 400 on a bad header."""
    cls = (priority or "interactive").strip().lower()
    if cls not in CLASSES:
        raise BadRequest(
            f"X-Priority must be one of {', '.join(CLASSES)}, not {priority!r}",
            param="X-Priority",
        )
    budget_ms = {
        "interactive": settings.budget_interactive_ms,
        "standard": settings.budget_standard_ms,
        "batch": settings.budget_batch_ms,
    }[cls]
    if budget is not None:
        try:
            budget_ms = int(budget)
        except ValueError:
            budget_ms = -1
        if budget_ms <= 0:
            raise BadRequest(
                f"X-Latency-Budget-Ms must be a positive integer, not {budget!r}",
                param="X-Latency-Budget-Ms",
            )
    return Admission(cls, arrival_ms, arrival_ms + budget_ms)
