"""The messages that cross process boundaries, and their msgpack encoding.

Every message is a frozen, slotted dataclass. On the wire it is a msgpack array
``[kind, version, field1, field2, ...]`` in declaration order: compact, fast to build and
parse, and explicit about its version. Decoding rejects an unknown kind or version with a
:class:`ProtocolError` instead of guessing. Never pickle: workers and gateways may run
different builds, and a Redis shared with other services must not execute anything.

Adding a field: append it with a default and bump ``VERSION``; decoders accept the
versions listed in ``_ACCEPTED``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

import msgpack

from cluster.errors import ProtocolError
from cluster.wire.vocabulary import PriorityClass

VERSION = 8
_ACCEPTED = frozenset({1, 2, 3, 4, 5, 6, 7, 8})


# The roleplay samplers' fields (DRY, XTC, banned strings; docs/api.md#roleplay-samplers):
# not ``SamplingParams`` fields, a worker hands them to its logits processors through
# ``SamplingParams.extra_args`` (workers/engines/samplers.py).
ROLEPLAY_SAMPLING_FIELDS = frozenset(
    {
        "dry_multiplier",
        "dry_base",
        "dry_allowed_length",
        "dry_penalty_last_n",
        "dry_sequence_breakers",
        "xtc_threshold",
        "xtc_probability",
        "banned_strings",
    }
)

# The sampling fields a Job may carry (vLLM's ``SamplingParams`` names, and the roleplay
# samplers'): a gateway puts only these in a job, and a worker hands vLLM only these.
SAMPLING_FIELDS = ROLEPLAY_SAMPLING_FIELDS | frozenset(
    {
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "min_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
        "structured_outputs",
        "logprobs",
    }
)


@dataclass(frozen=True, slots=True)
class Job:
    """One generation request, queued by a gateway and claimed by a worker."""

    KIND: ClassVar[str] = "job"

    id: str
    reply_to: str
    model: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: dict[str, Any]
    arrival_ms: int
    deadline_ms: int
    priority_class: str = PriorityClass.INTERACTIVE
    tenant: str = "default"
    attempt: int = 0
    # Tokens already delivered by an earlier attempt; a retry continues after them.
    resume_token_ids: list[int] = field(default_factory=list)
    resume_seq: int = 0
    # v3: the reply outlives its client (any gateway can serve its log); a job that is not
    # resumable stops once the gateway relaying it is gone.
    resumable: bool = False
    # v5: the W3C ``traceparent`` of the gateway's span for this request when tracing is on
    # (cluster/runtime/tracing.py): the worker's spans become its children. Empty when off.
    traceparent: str = ""

    @property
    def first_try(self) -> bool:
        """True for the job's first run: not a retry, nor a reply handed back mid-stream."""
        return self.attempt == 0 and self.resume_seq == 0

    @property
    def latency_bound(self) -> bool:
        """True unless batch work (:attr:`PriorityClass.latency_bound`; compared as text,
        so a class this worker does not know is not an error here)."""
        return self.priority_class != PriorityClass.BATCH


@dataclass(frozen=True, slots=True)
class Chunk:
    """A piece of a reply: a text delta with cumulative counts, or the end of the reply.

    ``seq`` starts at 1 and increases by one per chunk of a request, so a receiver can
    detect a gap. ``finish_reason`` is set only on the last chunk; ``error_code`` is set
    when the reply ended in error (then ``finish_reason`` is ``"error"``).
    """

    KIND: ClassVar[str] = "chunk"

    request_id: str
    seq: int
    text: str
    completion_tokens: int
    prompt_tokens: int
    finish_reason: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    cached_tokens: int = 0
    worker_id: str = ""
    # Timings measured by the worker, in ms: queue wait (arrival -> claim), and
    # claim -> first token.
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    # v2: when the worker published this chunk (wall clock, ms), for the relay lag.
    sent_ms: float = 0.0
    # v4: for a job that asked for logprobs, one entry per token of ``token_ids``:
    # ``[text, logprob, [[alternative text, logprob], ...]]`` (the top alternatives, best
    # first). Empty otherwise.
    logprobs: list[Any] = field(default_factory=list)

    @property
    def is_final(self) -> bool:
        """True for the last chunk of a reply."""
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class ChunkBatch:
    """Several encoded :class:`Chunk` messages in one pub/sub message.

    A worker sends one per engine step and gateway inbox, so a gateway pays one message's
    parsing and one wake-up per step, not one per stream. Each item is a complete encoded
    Chunk (the same bytes the worker appends to that request's log), so a receiver checks
    every chunk's kind and version as if it had arrived alone.
    """

    KIND: ClassVar[str] = "chunks"

    chunks: list[bytes]


@dataclass(frozen=True, slots=True)
class Cancel:
    """Stop a request: remove it from the queue, or abort it in the engine."""

    KIND: ClassVar[str] = "cancel"

    request_id: str
    reason: str = "client_disconnected"


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """What a worker publishes with each heartbeat: capacity and recent rates."""

    KIND: ClassVar[str] = "stats"

    worker_id: str
    max_slots: int
    running: int
    ts_ms: int
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    claimed_total: int = 0
    draining: bool = False
    # Jobs finished per second over the last heartbeat, and the time from claim to first
    # token (ms) of one short prompt: the recent average per prefill, each divided by the
    # prefills it shared the engine with (workers/loop/prefill.py).
    completed_per_s: float = 0.0
    prefill_ms: float = 0.0
    # v3: the recent cost of a prompt token in a prefill (ms): an uncached token's, learnt
    # from busy periods of 256 uncached tokens or more (0 until then), times the recent
    # uncached share of prompts. What admission estimates prompts from.
    prefill_ms_per_token: float = 0.0
    # v4: whether the replica's engine honours a request's ``seed`` (vLLM's CPU build
    # cannot), so a gateway refuses a seed no replica can honour before queueing it.
    honours_seed: bool = True
    # v6: the LoRA adapters the replica has loaded: a job whose model is one of them goes
    # only to a replica that lists it (cluster/wire/queue.py), and a gateway refuses an
    # adapter no live replica lists.
    adapters: list[str] = field(default_factory=list)
    # v7: the chat prompt tokens awaiting their prefill now, at that cost (ms): what a
    # chat claimed now waits for before its own prompt is prefilled.
    prefill_queued_ms: float = 0.0
    # v8: Redis's time (ms) when the figures that change between beats (running jobs, the
    # prefills) were taken, which a rewrite between beats moves on and ``ts_ms`` does not:
    # a gateway counts what it admitted after this as not yet in them (0 from older builds).
    at_ms: int = 0

    @property
    def free_slots(self) -> int:
        """Batch slots not in use."""
        return max(0, self.max_slots - self.running)


Message = Job | Chunk | ChunkBatch | Cancel | WorkerStats
M = TypeVar("M", Job, Chunk, ChunkBatch, Cancel, WorkerStats)

_TYPES: dict[str, type[Any]] = {
    cls.KIND: cls for cls in (Job, Chunk, ChunkBatch, Cancel, WorkerStats)
}
_FIELDS: dict[type[Any], tuple[str, ...]] = {
    cls: tuple(f.name for f in fields(cls)) for cls in _TYPES.values()
}


def encode(message: Message) -> bytes:
    """Encode one message as ``[kind, version, *fields]``."""
    names = _FIELDS[type(message)]
    return msgpack.packb(
        [message.KIND, VERSION, *(getattr(message, n) for n in names)], use_bin_type=True
    )


class ChunkEncoder:
    """Encodes chunks straight from their fields: the bytes of ``encode(Chunk(...))``
    without building the dataclass, with one reused packer.

    A worker encodes one chunk per stream per engine step, so this is its hottest
    encoding path. Not thread-safe (the packer is shared): one per publisher.
    """

    def __init__(self) -> None:
        self._pack = msgpack.Packer(use_bin_type=True).pack

    def chunk(
        self,
        request_id: str,
        seq: int,
        text: str,
        completion_tokens: int,
        prompt_tokens: int,
        finish_reason: str | None,
        error_code: str | None,
        error_message: str | None,
        cached_tokens: int,
        worker_id: str,
        queue_ms: float,
        prefill_ms: float,
        token_ids: list[int],
        sent_ms: float,
        logprobs: list[Any],
    ) -> bytes:
        """An encoded :class:`Chunk`; the parameters are its fields, in their order."""
        return self._pack(
            [
                Chunk.KIND,
                VERSION,
                request_id,
                seq,
                text,
                completion_tokens,
                prompt_tokens,
                finish_reason,
                error_code,
                error_message,
                cached_tokens,
                worker_id,
                queue_ms,
                prefill_ms,
                token_ids,
                sent_ms,
                logprobs,
            ]
        )

    def batch(self, items: list[bytes]) -> bytes:
        """An encoded :class:`ChunkBatch` of already encoded chunks."""
        return self._pack([ChunkBatch.KIND, VERSION, items])


def decode(data: bytes) -> Message:
    """Decode any message; raise :class:`ProtocolError` on anything unexpected."""
    try:
        items = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
        raise ProtocolError(f"not a charserve message: {exc}") from exc
    if not isinstance(items, list) or len(items) < 2:
        raise ProtocolError("not a charserve message: expected [kind, version, ...]")
    kind, version = items[0], items[1]
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    if version not in _ACCEPTED:
        raise ProtocolError(
            f"unsupported {kind} version {version!r} (this build reads {sorted(_ACCEPTED)})"
        )
    try:
        return cls(*items[2:])  # type: ignore[no-any-return]
    except TypeError as exc:
        raise ProtocolError(f"malformed {kind} message: {exc}") from exc


def decode_as(data: bytes, cls: type[M]) -> M:
    """Decode and check the message is of type ``cls``."""
    message = decode(data)
    if not isinstance(message, cls):
        raise ProtocolError(f"expected {cls.KIND}, got {message.KIND}")
    return message


def decode_chunks(data: bytes) -> list[Chunk]:
    """The chunks of an inbox message: a :class:`ChunkBatch`, or a single :class:`Chunk`
    (what workers of an earlier build send)."""
    message = decode(data)
    if isinstance(message, Chunk):
        return [message]
    if not isinstance(message, ChunkBatch) or not isinstance(message.chunks, list):
        raise ProtocolError(f"expected chunks, got {message.KIND}")
    if not all(isinstance(item, bytes) for item in message.chunks):
        raise ProtocolError("malformed chunks message: items must be encoded chunks")
    return [decode_as(item, Chunk) for item in message.chunks]
