"""Roleplay samplers inside vLLM's continuous batching: DRY, XTC and banned strings, as vLLM
v1 logits processors (``vllm/v1/sample/logits_processor/interface.py``).

Two halves, in two processes:

- :class:`SamplerTokens` runs in the worker (the Serve replica, beside ``AsyncLLM``). It turns
  a job's roleplay fields (their API names, :data:`cluster.wire.protocol.ROLEPLAY_SAMPLING_FIELDS`)
  into ``SamplingParams.extra_args`` holding token ids only, so the engine core's step loop,
  which every request in the batch waits on, never tokenizes.
- :class:`BannedStringsLogitsProcessor`, :class:`DryLogitsProcessor` and
  :class:`XtcLogitsProcessor` run in vLLM's engine core, registered by their fully-qualified
  names in the ``logits_processors`` engine argument
  (:data:`workers.engines.config.SAMPLER_PROCESSORS`). Each keeps
  per-request state keyed by the request's row in the persistent batch, updated from every
  ``BatchUpdate`` in the interface's order (removed, then added, then moved: a move carries
  the state to its new row, a swap exchanges two). A request without its fields has no state:
  its logits row is never read or written, and a batch without any such request costs one
  dict check per step.

vLLM applies these processors (they are not argmax-invariant) to the float32 logits after
``allowed_token_ids``, ``bad_words``, ``min_tokens`` and ``logit_bias``, and before its own
repetition/frequency/presence penalties, temperature, ``min_p``, ``top_k`` and ``top_p``
(``vllm/v1/sample/sampler.py``, ``apply_logits_processors``), greedy requests included. They
run in the order of ``SAMPLER_PROCESSORS``: banned strings, then DRY, then XTC (so XTC's
probabilities already exclude banned tokens and include DRY's penalties).

Definitions implemented (``h`` is a request's context: its prompt token ids followed by its
output token ids so far; ``n = len(h)``):

DRY ("Don't Repeat Yourself", p-e-w; text-generation-webui's ``DRYLogitsProcessor``). On
when ``dry_multiplier > 0``.

- The window: ``w = h[-dry_penalty_last_n:]`` when ``dry_penalty_last_n > 0``, else all of
  ``h`` (0 and -1 both mean the whole context).
- Sequence breakers: a token breaks sequences when its decoded text contains one of the
  ``dry_sequence_breakers`` strings (KoboldCpp's rule, so ``"\\n"`` also covers a ``"\\n\\n"``
  or ``".\\n"`` token); a breaker that no single token contains (it spans tokens) instead makes
  the last token of ``tokenize("a" + breaker)`` a breaker (text-generation-webui's rule).
  Default breakers: ``["\\n", ":", "\\"", "*"]``; ``[]`` means none.
- If the last token ``w[-1]`` is a breaker, nothing is penalized. Otherwise, for every
  ``i < len(w) - 1`` with ``w[i] == w[-1]`` whose next token ``t = w[i + 1]`` is not a
  breaker, the match length ``L`` is the number of tokens, counted back from ``i`` and from
  the end of ``w`` together, that are equal, none a breaker, without leaving the window,
  capped at :data:`DRY_MAX_MATCH` (50, webui's cap). So ``L >= 1``.
- Each such ``t`` takes the largest ``L`` over its occurrences; when ``L >=
  dry_allowed_length`` its logit is lowered by ``dry_multiplier * dry_base ** (L -
  dry_allowed_length)``, capped at :data:`DRY_MAX_PENALTY` (finite, so DRY alone never
  leaves a row without a candidate).

Cost per step per DRY request: one vectorized comparison over the window (``O(len(w))``);
occurrences whose match cannot reach ``dry_allowed_length`` are dropped one step back at a
time, and the rest compared at most 50 tokens back at once (``O(survivors * 50)``); a
step's new tokens are appended to a cached NumPy copy of the context (breaker flags
included), never rebuilt. ``dry_penalty_last_n`` bounds the window. Measured here (one
thread, 49k vocabulary): 32 requests with 2048-token contexts, about 1 ms per step.

XTC ("Exclude Top Choices", p-e-w). On when ``xtc_probability > 0``.

- Each step, a uniform draw ``u`` in [0, 1); XTC acts when ``u < xtc_probability``.
- ``p = softmax(logits)`` of the row (float32, at temperature 1: vLLM's temperature comes
  after; computed as ``exp(logit - logsumexp)`` over the row's ``1 / threshold + 1`` best
  tokens, as no more can reach the threshold). The candidates are the tokens with
  ``p >= xtc_threshold`` and ``p > 0`` (the second condition only matters at threshold 0:
  a masked token is never "a top choice"). With at least two candidates, every candidate
  but the least likely one is set to ``-inf`` (ties: the lowest token id is kept). Unlike
  text-generation-webui, newline and EOS tokens are not exempted (KoboldCpp's definition,
  as specified for charserve).
- The draw: with a request ``seed``, ``u`` is the ``k``-th output of SplitMix64 seeded with
  the seed, where ``k`` is the number of tokens generated so far, so a seeded request draws
  the same whatever it is batched with, preempted or chunked; without one, ``u`` comes from
  torch's global generator (which vLLM seeds with the engine's ``seed``).

Banned strings. Exact at token level, not at text level (a logits processor cannot
backtrack, as KoboldCpp's and TabbyAPI's implementations do):

- Each string becomes its token sequences: ``tokenize(s)`` and, unless ``s`` begins with
  whitespace, ``tokenize(" " + s)`` (the word at the start of a line or after a quote, and
  after a space); no special tokens added.
- A one-token sequence's token is always ``-inf``. For a longer sequence ``q`` of ``m``
  tokens, when the last ``m - 1`` tokens of ``h`` (prompt included, so a sequence begun at
  the end of a prompt cannot be completed either) equal ``q[:m - 1]``, ``q[m - 1]`` is
  ``-inf``. Only the last token is banned: banning earlier ones would also forbid harmless
  prefixes ("I am" for "I am a robot").
- Guaranteed: none of those token sequences ever ends in the output. Not guaranteed: the
  string's text can still appear through another tokenization (inside a longer word, with
  other casing, split differently, across a token that merges its first characters with
  what precedes them); and the model may write every token but the last (it then has to
  continue differently).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import structlog
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = structlog.get_logger(__name__)

# Matches are counted up to this many tokens (text-generation-webui's cap): it bounds the
# exponent, and each step's work per candidate.
DRY_MAX_MATCH = 50
# No single DRY penalty exceeds this: finite, and already far below any logit.
DRY_MAX_PENALTY = 1e30
DEFAULT_DRY_BASE = 1.75
DEFAULT_DRY_ALLOWED_LENGTH = 2
DEFAULT_DRY_SEQUENCE_BREAKERS: tuple[str, ...] = ("\n", ":", '"', "*")
DEFAULT_XTC_THRESHOLD = 0.1
XTC_MAX_THRESHOLD = 0.5

# The extra_args keys the processors read: token ids only (what SamplerTokens makes of the
# API fields). The numbers keep their API names.
DRY_MULTIPLIER = "dry_multiplier"
DRY_BASE = "dry_base"
DRY_ALLOWED_LENGTH = "dry_allowed_length"
DRY_PENALTY_LAST_N = "dry_penalty_last_n"
DRY_BREAKER_IDS = "dry_breaker_ids"  # list[int]
XTC_THRESHOLD = "xtc_threshold"
XTC_PROBABILITY = "xtc_probability"
BANNED_TOKEN_SEQUENCES = "banned_token_sequences"  # list[list[int]]

# Bounds the processors enforce themselves (the gateway's are tighter): what reaches the
# engine core through extra_args from any other client must not make a step slow.
_MAX_BREAKER_IDS = 1 << 20
_MAX_BANNED_SEQUENCES = 1024
_MAX_BANNED_SEQUENCE_TOKENS = 1024


# -- the worker's half: API fields -> token ids ---------------------------------------------


class SamplerTokens:
    """Turns a job's roleplay fields into the ``extra_args`` the processors read.

    Tokenization results are cached per string, and the decoded vocabulary (needed to find
    the tokens that contain a sequence breaker) is built once, on the first DRY request
    (about half a second for a 49k vocabulary): call :meth:`extra_args` off the event loop.
    Thread-safe.
    """

    _CACHE_ENTRIES = 4096

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._texts: list[str] | None = None
        self._breakers: dict[str, tuple[int, ...]] = {}
        self._sequences: dict[str, tuple[tuple[int, ...], ...]] = {}

    def extra_args(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """The processors' ``extra_args`` for a job's roleplay fields (their API names, as
        the gateway checked them); empty when none of the samplers is on."""
        out: dict[str, Any] = {}
        multiplier = fields.get("dry_multiplier")
        if multiplier:
            out[DRY_MULTIPLIER] = float(multiplier)
            for key in (DRY_BASE, DRY_ALLOWED_LENGTH, DRY_PENALTY_LAST_N):
                if fields.get(key) is not None:
                    out[key] = fields[key]
            breakers = fields.get("dry_sequence_breakers")
            out[DRY_BREAKER_IDS] = self.breaker_ids(
                DEFAULT_DRY_SEQUENCE_BREAKERS if breakers is None else breakers
            )
        probability = fields.get("xtc_probability")
        if probability:
            out[XTC_PROBABILITY] = float(probability)
            threshold = fields.get("xtc_threshold")
            out[XTC_THRESHOLD] = float(DEFAULT_XTC_THRESHOLD if threshold is None else threshold)
        banned = fields.get("banned_strings")
        if banned:
            out[BANNED_TOKEN_SEQUENCES] = self.banned_sequences(
                [banned] if isinstance(banned, str) else banned
            )
        return out

    def breaker_ids(self, breakers: Iterable[str]) -> list[int]:
        """The token ids that break DRY's sequences (module docstring), sorted."""
        ids: set[int] = set()
        for breaker in breakers:
            cached = self._breakers.get(breaker)
            if cached is None:
                cached = self._breaker_tokens(breaker)
                self._remember(self._breakers, breaker, cached)
            ids.update(cached)
        return sorted(ids)

    def banned_sequences(self, strings: Iterable[str]) -> list[list[int]]:
        """The token sequences of banned strings (module docstring), without duplicates."""
        seen: set[tuple[int, ...]] = set()
        out: list[list[int]] = []
        for text in strings:
            cached = self._sequences.get(text)
            if cached is None:
                variants = [text] if text[:1].isspace() else [text, " " + text]
                cached = tuple(dict.fromkeys(seq for seq in map(self._encode, variants) if seq))
                self._remember(self._sequences, text, cached)
            for seq in cached:
                if seq not in seen:
                    seen.add(seq)
                    out.append(list(seq))
        return out

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self._tokenizer.encode(text, add_special_tokens=False))

    def _breaker_tokens(self, breaker: str) -> tuple[int, ...]:
        contained = tuple(i for i, text in enumerate(self._vocabulary()) if breaker in text)
        if contained:
            return contained
        # It spans tokens: the token that ends it in running text (webui's rule).
        ends = self._encode("a" + breaker)
        return ends[-1:]

    def _vocabulary(self) -> list[str]:
        """Every token id's decoded text, built once."""
        with self._lock:
            if self._texts is None:
                ids = [[i] for i in range(len(self._tokenizer))]
                batch_decode = getattr(self._tokenizer, "batch_decode", None)
                if batch_decode is not None:
                    self._texts = list(batch_decode(ids))
                else:
                    self._texts = [self._tokenizer.decode(i) for i in ids]
            return self._texts

    def _remember(self, cache: dict[str, Any], key: str, value: Any) -> None:
        with self._lock:
            if len(cache) >= self._CACHE_ENTRIES:
                cache.clear()  # unbounded distinct strings from clients: start over
            cache[key] = value


# -- extra_args parsing (validate_params in the frontend, the same checks in the core) ----


def _number(
    args: Mapping[str, Any],
    key: str,
    default: float,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
) -> float:
    value = args.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    if value < low or (low_open and value == low) or value > high:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"{key} must be in {bounds}, got {value!r}")
    return float(value)


def _integer(args: Mapping[str, Any], key: str, default: int, *, low: int, high: int) -> int:
    value = args.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{key} must be in [{low}, {high}], got {value!r}")
    return value


def _token_ids(value: Any, key: str, limit: int) -> list[int]:
    if not isinstance(value, list | tuple) or len(value) > limit:
        raise ValueError(f"{key} must be a list of at most {limit} token ids")
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"{key} must hold token ids (integers >= 0), got {token!r}")
    return list(value)


@dataclass(frozen=True, slots=True)
class DryArgs:
    """A request's DRY settings, from ``extra_args``."""

    multiplier: float
    base: float
    allowed_length: int
    penalty_last_n: int
    breaker_ids: tuple[int, ...]

    @classmethod
    def parse(cls, args: Mapping[str, Any]) -> DryArgs | None:
        """The settings, or None when DRY is off; ValueError for a bad value."""
        if args.get(DRY_MULTIPLIER) is None:
            return None
        multiplier = _number(args, DRY_MULTIPLIER, 0.0, low=0.0)
        parsed = cls(
            multiplier,
            _number(args, DRY_BASE, DEFAULT_DRY_BASE, low=1.0, low_open=True),
            _integer(
                args, DRY_ALLOWED_LENGTH, DEFAULT_DRY_ALLOWED_LENGTH, low=1, high=DRY_MAX_MATCH
            ),
            _integer(args, DRY_PENALTY_LAST_N, 0, low=-1, high=2**63 - 1),
            tuple(_token_ids(args.get(DRY_BREAKER_IDS, []), DRY_BREAKER_IDS, _MAX_BREAKER_IDS)),
        )
        return parsed if multiplier > 0 else None

    def penalties(self) -> np.ndarray:
        """The penalty for each match length 0..DRY_MAX_MATCH (0 below allowed_length)."""
        table = np.zeros(DRY_MAX_MATCH + 1, dtype=np.float64)
        ceiling = math.log(DRY_MAX_PENALTY)
        for length in range(self.allowed_length, DRY_MAX_MATCH + 1):
            exponent = length - self.allowed_length
            # In logs first: base ** exponent may overflow a float.
            if math.log(self.multiplier) + exponent * math.log(self.base) >= ceiling:
                table[length] = DRY_MAX_PENALTY
            else:
                table[length] = self.multiplier * self.base**exponent
        return table


@dataclass(frozen=True, slots=True)
class XtcArgs:
    """A request's XTC settings, from ``extra_args``."""

    threshold: float
    probability: float

    @classmethod
    def parse(cls, args: Mapping[str, Any]) -> XtcArgs | None:
        """The settings, or None when XTC is off; ValueError for a bad value."""
        if args.get(XTC_PROBABILITY) is None:
            return None
        parsed = cls(
            _number(args, XTC_THRESHOLD, DEFAULT_XTC_THRESHOLD, low=0.0, high=XTC_MAX_THRESHOLD),
            _number(args, XTC_PROBABILITY, 0.0, low=0.0, high=1.0),
        )
        return parsed if parsed.probability > 0 else None


def parse_banned(args: Mapping[str, Any]) -> list[list[int]] | None:
    """A request's banned token sequences, or None; ValueError for a bad value."""
    value = args.get(BANNED_TOKEN_SEQUENCES)
    if value is None:
        return None
    if not isinstance(value, list | tuple) or len(value) > _MAX_BANNED_SEQUENCES:
        raise ValueError(
            f"{BANNED_TOKEN_SEQUENCES} must be a list of at most {_MAX_BANNED_SEQUENCES} "
            "token sequences"
        )
    sequences = [
        _token_ids(seq, BANNED_TOKEN_SEQUENCES, _MAX_BANNED_SEQUENCE_TOKENS) for seq in value
    ]
    if any(not seq for seq in sequences):
        raise ValueError(f"{BANNED_TOKEN_SEQUENCES} may not hold an empty sequence")
    return sequences or None


# -- the engine core's half: the processors ---------------------------------------------

S = TypeVar("S")


def _vocab_size(vllm_config: Any) -> int | None:
    try:
        return int(vllm_config.model_config.get_vocab_size())
    except AttributeError:
        return None


class _PerRequestProcessor(LogitsProcessor, Generic[S]):
    """Per-request state keyed by batch row, kept in step with vLLM's ``BatchUpdate``s."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        # Token ids beyond the model's vocabulary (from a client that bypassed the worker's
        # tokenizer) are dropped: indexing the logits with them would fail the whole step.
        self.vocab_size = _vocab_size(vllm_config)
        self.states: dict[int, S] = {}
        self._neg_inf = torch.tensor(-math.inf, dtype=torch.float32, device=device)

    def is_argmax_invariant(self) -> bool:
        """All three change which token is the most likely: greedy requests need them too."""
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Apply the batch's changes in the interface's order: removed, added, moved."""
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.states.pop(index, None)
        for index, params, prompt_ids, output_ids in batch_update.added:
            state = self._new_state_or_none(params, prompt_ids or [], output_ids)
            if state is None:
                self.states.pop(index, None)  # a request without the fields replaces one with
            else:
                self.states[index] = state
        for a, b, direction in batch_update.moved:
            a_state = self.states.pop(a, None)
            b_state = self.states.pop(b, None)
            if a_state is not None:
                self.states[b] = a_state
            if direction == MoveDirectionality.SWAP and b_state is not None:
                self.states[a] = b_state

    def _new_state_or_none(
        self, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
    ) -> S | None:
        if not params.extra_args:
            return None
        try:
            return self.new_state(params, prompt_ids, output_ids)
        except (TypeError, ValueError) as exc:
            # validate_params refused these in the frontend already; an exception here would
            # fail every request in the batch, so the request runs without this sampler.
            log.error(
                "roleplay sampler arguments refused", sampler=type(self).__name__, error=str(exc)
            )
            return None

    def new_state(
        self, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
    ) -> S | None:
        """The state of a request entering the batch, or None when it does not use this
        sampler. ``output_ids`` is vLLM's live list of the request's output tokens."""
        raise NotImplementedError

    def _in_vocab(self, ids: Iterable[int]) -> list[int]:
        limit = self.vocab_size
        return [t for t in ids if limit is None or t < limit]


# Banned strings ---------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _BannedState:
    always: list[int]  # one-token sequences
    # (prefix length, {prefix: tokens that would complete a banned sequence}), longest first
    groups: list[tuple[int, dict[tuple[int, ...], list[int]]]]
    context: int  # the longest prefix
    prompt_tail: list[int]  # the last ``context`` prompt tokens
    output: list[int]  # vLLM's live output list

    def tail(self) -> list[int]:
        """The last ``context`` tokens of prompt + output."""
        out = self.output
        need = self.context
        if len(out) >= need:
            return out[len(out) - need :]
        return self.prompt_tail[max(0, len(self.prompt_tail) - (need - len(out))) :] + out


class BannedStringsLogitsProcessor(_PerRequestProcessor[_BannedState]):
    """Banned strings as banned token sequences (module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        parse_banned(sampling_params.extra_args or {})

    def new_state(
        self, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
    ) -> _BannedState | None:
        sequences = parse_banned(params.extra_args or {})
        if not sequences:
            return None
        always: set[int] = set()
        by_length: dict[int, dict[tuple[int, ...], set[int]]] = {}
        for seq in sequences:
            if not self._in_vocab(seq[-1:]):
                continue  # its last token is beyond the logits: never sampled anyway
            if len(seq) == 1:
                always.add(seq[0])
            else:
                prefix = tuple(seq[:-1])
                by_length.setdefault(len(prefix), {}).setdefault(prefix, set()).add(seq[-1])
        if not always and not by_length:
            return None
        groups = [
            (length, {prefix: sorted(tokens) for prefix, tokens in table.items()})
            for length, table in sorted(by_length.items(), reverse=True)
        ]
        context = groups[0][0] if groups else 0
        return _BannedState(
            sorted(always),
            groups,
            context,
            list(prompt_ids[-context:]) if context else [],
            output_ids,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        rows: list[int] = []
        tokens: list[int] = []
        for row, state in self.states.items():
            if state.always:
                rows.extend([row] * len(state.always))
                tokens.extend(state.always)
            if state.groups:
                tail = state.tail()
                for length, table in state.groups:
                    if len(tail) < length:
                        continue
                    completing = table.get(tuple(tail[len(tail) - length :]))
                    if completing:
                        rows.extend([row] * len(completing))
                        tokens.extend(completing)
        if rows:
            index = (
                torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True),
                torch.tensor(tokens, dtype=torch.long).to(logits.device, non_blocking=True),
            )
            logits.index_put_(index, self._neg_inf.to(logits.dtype))
        return logits


# DRY --------------------------------------------------------------------------------------

_NO_MATCHES = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))


def dry_matches(
    tokens: np.ndarray, breaks: np.ndarray, min_length: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """DRY's matches in a window (module docstring) of at least ``min_length`` tokens: for
    each earlier occurrence of the last token whose next token is not a breaker and whose
    match is that long, the next token and the match length.

    ``tokens`` is the window (int64), ``breaks`` whether each of its tokens is a breaker. A
    token may appear several times in the result; the caller takes its longest match.
    """
    n = int(tokens.shape[0])
    if n < 2 or breaks[n - 1]:
        return _NO_MATCHES
    # The matched suffix never holds a breaker: the run of non-breakers that ends the
    # window bounds every match (tail[0] is the last token, not a breaker).
    tail = breaks[max(0, n - DRY_MAX_MATCH) :][::-1]
    hit = np.flatnonzero(tail)
    limit = int(hit[0]) if hit.size else int(tail.shape[0])
    if limit < min_length:
        return _NO_MATCHES
    starts = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])
    if starts.size:
        starts = starts[~breaks[starts + 1]]
    # Shorter matches are of no use: drop them one step back at a time (most occurrences
    # of a token fail the first step), before the full comparison below.
    for step in range(1, min_length):
        if not starts.size:
            break
        starts = starts[starts >= step]
        starts = starts[tokens[starts - step] == tokens[n - 1 - step]]
    if not starts.size:
        return _NO_MATCHES
    known = max(min_length, 1)  # every start left matches this far
    lengths = np.full(starts.shape[0], known, dtype=np.int64)
    if limit > known:
        back = np.arange(known, limit, dtype=np.int64)
        earlier = starts[:, None] - back[None, :]
        equal = earlier >= 0
        equal &= tokens[np.maximum(earlier, 0)] == tokens[n - 1 - back][None, :]
        # The run of equal tokens from there on: the first mismatch ends it.
        lengths += np.where(equal.all(axis=1), back.shape[0], equal.argmin(axis=1))
    return tokens[starts + 1], lengths


@dataclass(slots=True, eq=False)
class _DryState:
    allowed_length: int
    window: int  # tokens of context scanned; 0: all
    breakers: np.ndarray  # sorted breaker ids
    breaker_set: frozenset[int]  # the same, for a step's few new tokens
    penalties: np.ndarray  # by match length
    prompt: np.ndarray  # the prompt (its last ``window`` tokens when windowed)
    output: list[int]  # vLLM's live output list
    tokens: np.ndarray = field(init=False)  # prompt + output so far, as int64
    breaks: np.ndarray = field(init=False)  # whether each of ``tokens`` is a breaker
    size: int = field(init=False)
    seen: int = field(init=False)  # output tokens copied into ``tokens``

    def __post_init__(self) -> None:
        self._rebuild()

    def _rebuild(self) -> None:
        capacity = max(64, 2 * (self.prompt.shape[0] + len(self.output)))
        self.tokens = np.empty(capacity, dtype=np.int64)
        self.breaks = np.empty(capacity, dtype=bool)
        self.size = 0
        self.seen = 0
        self._append(self.prompt)

    def _append(self, new: np.ndarray) -> None:
        needed = self.size + new.shape[0]
        if needed > self.tokens.shape[0]:
            keep = self.size if self.window <= 0 else min(self.size, self.window)
            capacity = max(self.tokens.shape[0], 2 * (keep + new.shape[0]))
            tokens = np.empty(capacity, dtype=np.int64)
            breaks = np.empty(capacity, dtype=bool)
            tokens[:keep] = self.tokens[self.size - keep : self.size]
            breaks[:keep] = self.breaks[self.size - keep : self.size]
            self.tokens, self.breaks, self.size = tokens, breaks, keep
        end = self.size + new.shape[0]
        self.tokens[self.size : end] = new
        if new.shape[0] <= 16:  # a step's tokens: np.isin costs more than a set lookup
            self.breaks[self.size : end] = [t in self.breaker_set for t in new.tolist()]
        else:
            self.breaks[self.size : end] = np.isin(new, self.breakers)
        self.size = end

    def window_view(self) -> tuple[np.ndarray, np.ndarray]:
        """The window's tokens and breaker flags, with the output tokens generated since the
        last step appended."""
        out = self.output
        if len(out) < self.seen:
            self._rebuild()  # vLLM discarded tokens (a KV-load failure): start over
        if len(out) > self.seen:
            new = out[self.seen :]
            # With async scheduling the newest token can be a placeholder (-1) until vLLM
            # fills it in; it is taken on a later step.
            for k, token in enumerate(new):
                if token < 0:
                    new = new[:k]
                    break
            if new:
                self._append(np.asarray(new, dtype=np.int64))
                self.seen += len(new)
        start = max(0, self.size - self.window) if self.window > 0 else 0
        return self.tokens[start : self.size], self.breaks[start : self.size]


class DryLogitsProcessor(_PerRequestProcessor[_DryState]):
    """DRY (module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        DryArgs.parse(sampling_params.extra_args or {})

    def new_state(
        self, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
    ) -> _DryState | None:
        args = DryArgs.parse(params.extra_args or {})
        if args is None:
            return None
        window = args.penalty_last_n if args.penalty_last_n > 0 else 0
        prompt = prompt_ids[-window:] if window else prompt_ids
        return _DryState(
            allowed_length=args.allowed_length,
            window=window,
            breakers=np.unique(np.asarray(args.breaker_ids, dtype=np.int64)),
            breaker_set=frozenset(args.breaker_ids),
            penalties=args.penalties(),
            prompt=np.asarray(prompt, dtype=np.int64),
            output=output_ids,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        vocab = logits.shape[-1]
        rows: list[np.ndarray] = []
        tokens: list[np.ndarray] = []
        penalties: list[np.ndarray] = []
        for row, state in self.states.items():
            following, lengths = dry_matches(*state.window_view(), state.allowed_length)
            keep = following < vocab
            if not keep.any():
                continue
            following, lengths = following[keep], lengths[keep]
            # The longest match of each token: sort by (token, length), take each token's last.
            order = np.lexsort((lengths, following))
            following, lengths = following[order], lengths[order]
            last = np.ones(following.shape[0], dtype=bool)
            last[:-1] = following[1:] != following[:-1]
            following, lengths = following[last], lengths[last]
            rows.append(np.full(following.shape[0], row, dtype=np.int64))
            tokens.append(following)
            penalties.append(state.penalties[lengths])
        if rows:
            index = (
                torch.from_numpy(np.concatenate(rows)).to(logits.device, non_blocking=True),
                torch.from_numpy(np.concatenate(tokens)).to(logits.device, non_blocking=True),
            )
            values = torch.from_numpy(-np.concatenate(penalties)).to(
                device=logits.device, dtype=logits.dtype
            )
            # Each (row, token) appears once: accumulate subtracts each penalty once.
            logits.index_put_(index, values, accumulate=True)
        return logits


# XTC --------------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def splitmix_unit(seed: int, k: int) -> float:
    """The ``k``-th (from 0) output of SplitMix64 seeded with ``seed``, as a float in
    [0, 1): a draw that depends on the seed and the step only."""
    z = (seed + (k + 1) * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


@dataclass(slots=True, eq=False)
class _XtcState:
    threshold: float
    probability: float
    seed: int | None
    output: list[int]  # vLLM's live output list: its length is the step number


def xtc_remove(logits: torch.Tensor, thresholds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """XTC's cut for whole rows (module docstring), the draw already won: the (row, token)
    pairs to remove. ``thresholds`` has one value per row.

    No more than ``1 / threshold`` tokens can reach the threshold, so only that many of
    each row's best tokens are looked at (``topk``), with ``p = exp(logit - logsumexp)``:
    two passes over the vocabulary, where a softmax and masks over it would take several.
    """
    vocab = logits.shape[-1]
    lowest = float(thresholds.min())
    k = vocab if lowest <= 0 else min(vocab, int(1.0 / lowest) + 1)
    top, ids = logits.topk(k, dim=-1)  # sorted: candidates are a prefix of each row
    probs = (top - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
    candidate = (probs >= thresholds[:, None]) & (probs > 0)
    # The least likely candidate stays; among equals, the lowest token id.
    least = probs.masked_fill(~candidate, math.inf).amin(dim=-1, keepdim=True)
    tied = candidate & (probs == least)
    kept = ids.masked_fill(~tied, vocab).amin(dim=-1, keepdim=True)
    # One candidate: it is the kept one, nothing is removed; none: nothing to remove.
    remove = candidate & (ids != kept)
    rows = torch.arange(logits.shape[0], device=logits.device)[:, None].expand_as(ids)
    return rows[remove], ids[remove]


class XtcLogitsProcessor(_PerRequestProcessor[_XtcState]):
    """XTC (module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        XtcArgs.parse(sampling_params.extra_args or {})

    def new_state(
        self, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
    ) -> _XtcState | None:
        args = XtcArgs.parse(params.extra_args or {})
        if args is None:
            return None
        return _XtcState(args.threshold, args.probability, params.seed, output_ids)

    def draws(self) -> dict[int, float]:
        """This step's draw for each XTC row."""
        unseeded = [row for row, state in self.states.items() if state.seed is None]
        shared = iter(torch.rand(len(unseeded)).tolist()) if unseeded else iter(())
        return {
            row: splitmix_unit(state.seed, len(state.output))
            if state.seed is not None
            else next(shared)
            for row, state in self.states.items()
        }

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        draws = self.draws()
        rows = [row for row, state in self.states.items() if draws[row] < state.probability]
        if not rows:
            return logits
        index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
        thresholds = torch.tensor(
            [self.states[row].threshold for row in rows], dtype=torch.float32
        ).to(logits.device, non_blocking=True)
        # All rows at once when all take part: no copy of the rows out and back.
        everyone = len(rows) == logits.shape[0] and rows == sorted(rows)
        selected = logits if everyone else logits.index_select(0, index)
        local, tokens = xtc_remove(selected, thresholds)
        logits.index_put_((index[local], tokens), self._neg_inf.to(logits.dtype))
        return logits


def active_fields(fields: Mapping[str, Any]) -> Sequence[str]:
    """The roleplay fields of a job that ask for something (the rest hold neutral values),
    in a stable order: what a replica without the processors refuses."""
    on = []
    if fields.get("dry_multiplier"):
        on.append("dry_multiplier")
    if fields.get("xtc_probability"):
        on.append("xtc_probability")
    if fields.get("banned_strings"):
        on.append("banned_strings")
    return on
