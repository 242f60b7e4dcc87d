"""Retry hints: the headers a refusal carries, and how charserve's own clients read them.

A refusal says when to come back twice: ``Retry-After`` in whole seconds (RFC 9110, what
every client reads) and ``retry-after-ms`` in milliseconds (what the openai SDK reads
first, as OpenAI's own API sends it). A budget refusal whose estimate is 365 ms over the
budget then asks for 365 ms, not a whole second.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

RETRY_AFTER = "Retry-After"
RETRY_AFTER_MS = "retry-after-ms"
# A hint is bounded: a refusal never asks a client to wait more than a day.
MAX_RETRY_AFTER_MS = 86_400_000


def retry_headers(wait_ms: float) -> dict[str, str]:
    """Both hint headers for a wait of ``wait_ms`` (at least 1 ms and 1 s, at most a day)."""
    ms = min(MAX_RETRY_AFTER_MS, max(1, math.ceil(wait_ms)))
    return {RETRY_AFTER: str(max(1, math.ceil(ms / 1000))), RETRY_AFTER_MS: str(ms)}


def hinted_retry_s(headers: Mapping[str, str]) -> float | None:
    """The wait a response's headers ask for, in seconds: ``retry-after-ms`` first, then
    ``Retry-After`` in seconds; ``None`` when neither is a plain non-negative number."""
    lowered = {key.lower(): value for key, value in headers.items()}
    for name, per_s in ((RETRY_AFTER_MS, 1000.0), (RETRY_AFTER.lower(), 1.0)):
        value = lowered.get(name, "").strip()
        if value.isdigit():
            return int(value) / per_s
    return None
