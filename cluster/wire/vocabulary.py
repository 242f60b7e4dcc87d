"""The words gateways, workers, metrics and the API share, each spelled once.

Every value is a ``StrEnum``: it is its own string on the wire (msgpack, JSON, Redis),
in metric labels and in the OpenAPI document, and compares equal to that string, so a
message from a worker of another build still decodes into plain strings that match.
"""

from __future__ import annotations

from enum import StrEnum


class PriorityClass(StrEnum):
    """A request's admission class: its default budget and whether it yields."""

    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BATCH = "batch"

    @property
    def latency_bound(self) -> bool:
        """True for the classes whose time to first token a user waits for."""
        return self is not PriorityClass.BATCH


# Added to a batch job's queue score and vLLM priority: 2**50 ms is ~35,000 years past any
# deadline, so batch work sorts after every latency-bound job whatever budget it asked for,
# and still in deadline order among itself.
BATCH_SCORE_OFFSET = 1 << 50

# A LoRA adapter's name, as a replica's config and a character name it and a request's
# ``model`` does: a model name on the wire, a Redis key part, and a field of the queue's
# ``|``-separated job info, so short and plain.
ADAPTER_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
# Adapters one replica may load: each is listed in every heartbeat and every claim.
MAX_ADAPTERS = 64


class DropReason(StrEnum):
    """Why a request was refused at the door (``X-Charserve-Drop-Reason``)."""

    BUDGET = "budget"
    QUEUE_FULL = "queue_full"
    NO_WORKERS = "no_workers"
    EXPIRED = "expired"
    RATE_LIMITED = "rate_limited"
    TENANT_QUEUE_FULL = "tenant_queue_full"


class ErrorCode(StrEnum):
    """Why a reply ended in error: the ``error_code`` of a final chunk on the wire."""

    INVALID_REQUEST = "invalid_request_error"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    DEAD_LETTER = "dead_letter"
    LOST = "lost"
    INTERNAL = "internal_error"


class FinishReason(StrEnum):
    """How a reply ended. The first four are OpenAI's; vLLM adds ``abort`` and charserve
    ``error`` (the chunk then carries an :class:`ErrorCode`)."""

    STOP = "stop"
    LENGTH = "length"
    CONTENT_FILTER = "content_filter"
    TOOL_CALLS = "tool_calls"
    ABORT = "abort"
    ERROR = "error"

    @classmethod
    def openai(cls, value: str | None) -> FinishReason:
        """The OpenAI value a client sees for ``value`` (``abort`` and unknowns: stop)."""
        if value in _OPENAI_FINISH:
            return cls(value)
        return cls.STOP


_OPENAI_FINISH = frozenset({"stop", "length", "content_filter", "tool_calls"})


class Outcome(StrEnum):
    """How an admitted request ended, as the gateway counts it (a metric label)."""

    COMPLETED = "completed"
    ERROR = "error"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    SLOW_CONSUMER = "slow_consumer"

    @classmethod
    def of_error(cls, code: str | None) -> Outcome:
        """The outcome of a reply that ended with wire error ``code`` (None: completed)."""
        if code is None:
            return cls.COMPLETED
        if code == ErrorCode.EXPIRED:
            return cls.EXPIRED
        if code == ErrorCode.CANCELLED:
            return cls.CANCELLED
        return cls.ERROR
