"""The roleplay samplers' logits processors (workers/engines/samplers.py) against
straightforward per-request references, inside a simulated persistent batch: requests are
added into freed rows, removed, moved down by condensing and swapped, as vLLM's
``InputBatch`` does (vllm/v1/worker/gpu_input_batch.py), and rows of requests without the
fields must come out bitwise equal. No engine is started."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    validate_logits_processors_parameters,
)

from cluster.wire.protocol import ROLEPLAY_SAMPLING_FIELDS
from gateway.chat import schemas
from workers.engines.config import SAMPLER_PROCESSORS, EngineConfig
from workers.engines.samplers import (
    BANNED_TOKEN_SEQUENCES,
    DEFAULT_DRY_SEQUENCE_BREAKERS,
    DEFAULT_XTC_THRESHOLD,
    DRY_ALLOWED_LENGTH,
    DRY_BASE,
    DRY_BREAKER_IDS,
    DRY_MAX_MATCH,
    DRY_MAX_PENALTY,
    DRY_MULTIPLIER,
    DRY_PENALTY_LAST_N,
    XTC_MAX_THRESHOLD,
    XTC_PROBABILITY,
    XTC_THRESHOLD,
    BannedStringsLogitsProcessor,
    DryArgs,
    DryLogitsProcessor,
    SamplerTokens,
    XtcLogitsProcessor,
    splitmix_unit,
)
from workers.engines.vllm_engine import VllmEngine, roleplay_fields, sampling_kwargs
from workers.errors import InvalidJobError

INF = math.inf


# -- references: one request at a time, as the definitions read ------------------------


def reference_dry(
    context: list[int],
    breakers: set[int],
    multiplier: float,
    base: float,
    allowed: int,
    last_n: int,
) -> dict[int, float]:
    """text-generation-webui's DRYLogitsProcessor loop for one row: token -> penalty."""
    ids = context[-last_n:] if last_n > 0 else context
    if len(ids) < 2 or ids[-1] in breakers:
        return {}
    last = ids[-1]
    longest: dict[int, int] = {}
    for i in range(len(ids) - 1):
        if ids[i] != last or ids[i + 1] in breakers:
            continue
        length = 1
        while length < DRY_MAX_MATCH:
            j = i - length
            if j < 0:
                break
            previous = ids[-(length + 1)]
            if ids[j] != previous or previous in breakers:
                break
            length += 1
        longest[ids[i + 1]] = max(length, longest.get(ids[i + 1], 0))
    return {
        t: min(multiplier * base ** (n - allowed), DRY_MAX_PENALTY)
        for t, n in longest.items()
        if n >= allowed
    }


def reference_xtc(row: torch.Tensor, threshold: float) -> torch.Tensor:
    """XTC's cut for one row, the draw already won."""
    p = row.softmax(dim=-1)
    candidates = [t for t in range(row.shape[0]) if p[t] >= threshold and p[t] > 0]
    out = row.clone()
    if len(candidates) >= 2:
        kept = min(candidates, key=lambda t: (p[t].item(), t))
        for t in candidates:
            if t != kept:
                out[t] = -INF
    return out


def reference_banned(context: list[int], sequences: list[list[int]]) -> set[int]:
    """The tokens that would complete a banned sequence at the end of ``context``."""
    out = set()
    for seq in sequences:
        m = len(seq) - 1
        if m == 0 or (len(context) >= m and context[len(context) - m :] == seq[:-1]):
            out.add(seq[-1])
    return out


# -- a persistent batch as vLLM keeps it ------------------------------------------------


@dataclass
class Request:
    params: SamplingParams
    prompt: list[int]
    budget: int
    output: list[int] = field(default_factory=list)  # the live list processors hold

    @property
    def context(self) -> list[int]:
        return self.prompt + self.output


class Batch:
    """Rows of requests changed as vLLM's InputBatch changes them: removals free rows; a
    new request takes the lowest freed row, else the next one; condensing moves the last
    request into each remaining hole below it (one-way moves); then swaps."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.rows: list[Request | None] = []

    def change(self, new: list[Request], swaps: int) -> BatchUpdate | None:
        removed: list[int] = []
        for i, req in enumerate(self.rows):
            if req is not None and (len(req.output) >= req.budget or self.rng.random() < 0.08):
                self.rows[i] = None
                removed.append(i)
        removed.sort(reverse=True)  # vLLM's order; it hands out the lowest first
        added = []
        for req in new:
            index = removed.pop() if removed else len(self.rows)
            if index == len(self.rows):
                self.rows.append(req)
            else:
                self.rows[index] = req
            added.append((index, req.params, req.prompt, req.output))
        moved: list[tuple[int, int, MoveDirectionality]] = []
        holes = sorted(removed)
        last = len(self.rows) - 1
        while holes:
            while last >= 0 and self.rows[last] is None:
                last -= 1
            if holes[0] >= last:
                break
            hole = holes.pop(0)
            self.rows[hole], self.rows[last] = self.rows[last], None
            moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
            last -= 1
        while self.rows and self.rows[-1] is None:
            self.rows.pop()
        for _ in range(swaps if len(self.rows) > 1 else 0):
            a, b = self.rng.sample(range(len(self.rows)), 2)
            self.rows[a], self.rows[b] = self.rows[b], self.rows[a]
            moved.append((a, b, MoveDirectionality.SWAP))
        remaining = sorted(holes, reverse=True)
        if not (remaining or added or moved):
            return None
        return BatchUpdate(len(self.rows), remaining, added, moved)

    def live(self) -> list[Request]:
        assert all(r is not None for r in self.rows)
        return [r for r in self.rows if r is not None]


def fake_vllm_config(vocab: int) -> Any:
    return SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: vocab))


def build(cls: type[LogitsProcessor], vocab: int) -> Any:
    return cls(fake_vllm_config(vocab), torch.device("cpu"), False)


def run_batch(
    processor: Any,
    make_request: Callable[[random.Random], Request],
    expected_row: Callable[[Request, torch.Tensor], torch.Tensor],
    *,
    vocab: int,
    steps: int,
    seed: int,
) -> int:
    """Drive ``processor`` through ``steps`` batch changes and steps; check every row of
    every step against ``expected_row``; the rows it changed."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = Batch(rng)
    changed = 0
    for _ in range(steps):
        new = [make_request(rng) for _ in range(rng.choice([0, 0, 1, 2, 3]))]
        processor.update_state(batch.change(new, swaps=rng.choice([0, 0, 1, 2])))
        live = batch.live()
        if not live:
            continue
        logits = torch.randn(len(live), vocab, generator=gen) * 3
        original = logits.clone()
        out = processor.apply(logits)
        for row, req in enumerate(live):
            want = expected_row(req, original[row])
            assert torch.equal(out[row], want), (row, req.params.extra_args, req.context)
            changed += not torch.equal(want, original[row])
        # Each request's next token: a finite one of its row, at random.
        for row, req in enumerate(live):
            finite = torch.isfinite(out[row]).nonzero().flatten().tolist()
            req.output.append(rng.choice(finite))
    return changed


# -- DRY --------------------------------------------------------------------------------


def dry_request(rng: random.Random, vocab: int) -> Request:
    """Short alphabets make repeats; some requests without DRY, some windowed."""
    kind = rng.random()
    if kind < 0.25:
        extra: dict[str, Any] | None = None
    elif kind < 0.35:
        extra = {DRY_MULTIPLIER: 0.0}  # neutral
    else:
        extra = {
            DRY_MULTIPLIER: rng.choice([0.5, 0.8, 2.0]),
            DRY_BASE: rng.choice([1.1, 1.75, 3.0]),
            DRY_ALLOWED_LENGTH: rng.choice([1, 2, 3]),
            DRY_PENALTY_LAST_N: rng.choice([-1, 0, 0, 7, 20]),
            DRY_BREAKER_IDS: rng.sample(range(vocab), rng.choice([0, 1, 2])),
        }
    alphabet = rng.sample(range(vocab), 3)
    prompt = [rng.choice(alphabet) for _ in range(rng.randint(1, 30))]
    return Request(SamplingParams(extra_args=extra), prompt, budget=rng.randint(1, 40))


def dry_expected(req: Request, row: torch.Tensor) -> torch.Tensor:
    args = req.params.extra_args or {}
    if not args.get(DRY_MULTIPLIER):
        return row
    penalties = reference_dry(
        req.context,
        set(args[DRY_BREAKER_IDS]),
        args[DRY_MULTIPLIER],
        args[DRY_BASE],
        args[DRY_ALLOWED_LENGTH],
        args[DRY_PENALTY_LAST_N],
    )
    out = row.clone()
    for token, penalty in penalties.items():
        out[token] -= torch.tensor(penalty, dtype=torch.float64).float()
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dry_matches_the_reference_under_continuous_batching(seed: int) -> None:
    vocab = 6
    dry = build(DryLogitsProcessor, vocab)
    changed = run_batch(
        dry,
        lambda rng: dry_request(rng, vocab),
        dry_expected,
        vocab=vocab,
        steps=300,
        seed=seed,
    )
    assert changed > 100  # repeats were found and penalized, not just left alone


def test_dry_long_repeats_are_capped_and_stay_finite() -> None:
    # A long verbatim repeat: the match counts up to DRY_MAX_MATCH, the penalty is capped.
    dry = build(DryLogitsProcessor, 8)
    cycle = [1, 2, 3, 4, 5, 6]
    req = Request(
        SamplingParams(extra_args={DRY_MULTIPLIER: 5.0, DRY_BASE: 40.0, DRY_ALLOWED_LENGTH: 1}),
        cycle * 30,
        budget=10,
    )
    dry.update_state(BatchUpdate(1, [], [(0, req.params, req.prompt, req.output)], []))
    logits = torch.zeros(1, 8)
    dry.apply(logits)
    assert logits[0, 1].item() == float(np.float32(-DRY_MAX_PENALTY))
    assert torch.isfinite(logits).all()
    assert DryArgs(5.0, 40.0, 1, 0, ()).penalties()[DRY_MAX_MATCH] == DRY_MAX_PENALTY


def test_dry_follows_vllm_placeholders_and_discarded_tokens() -> None:
    """Async scheduling appends -1 until the token is known; a KV-load failure can drop
    output tokens: the cached context follows both."""
    vocab = 5
    dry = build(DryLogitsProcessor, vocab)
    args = {
        DRY_MULTIPLIER: 1.0,
        DRY_BASE: 2.0,
        DRY_ALLOWED_LENGTH: 1,
        DRY_PENALTY_LAST_N: 6,
        DRY_BREAKER_IDS: [],
    }
    req = Request(SamplingParams(extra_args=args), [1, 2, 1, 2, 3], budget=50)
    dry.update_state(BatchUpdate(1, [], [(0, req.params, req.prompt, req.output)], []))

    def check(context: list[int]) -> None:
        logits = torch.zeros(1, vocab)
        dry.apply(logits)
        want = dry_expected(Request(req.params, context, 0), torch.zeros(vocab))
        assert torch.equal(logits[0], want), context

    rng = random.Random(5)
    for _ in range(60):  # long enough for the windowed buffer to be compacted
        req.output.append(-1)
        check(req.context[:-1])  # the placeholder is not part of the context yet
        req.output[-1] = rng.randint(1, 3)
        check(req.context)
    del req.output[-7:]
    check(req.context)


# -- XTC --------------------------------------------------------------------------------


def xtc_request(rng: random.Random, vocab: int) -> Request:
    kind = rng.random()
    seed = rng.choice([None, rng.randrange(2**63)])
    if kind < 0.25:
        extra: dict[str, Any] | None = None
    elif kind < 0.35:
        extra = {XTC_PROBABILITY: 0.0, XTC_THRESHOLD: 0.1}  # neutral
    else:
        extra = {
            XTC_THRESHOLD: rng.choice([0.0, 0.05, 0.1, 0.2, 0.5]),
            # Unseeded draws come from torch's generator: only probability 1 is checked here.
            XTC_PROBABILITY: 1.0 if seed is None else rng.choice([0.3, 0.7, 1.0]),
        }
    return Request(SamplingParams(extra_args=extra, seed=seed), [1], budget=rng.randint(1, 30))


def xtc_expected(req: Request, row: torch.Tensor) -> torch.Tensor:
    args = req.params.extra_args or {}
    probability = args.get(XTC_PROBABILITY, 0.0)
    if not probability:
        return row
    if req.params.seed is not None:
        if splitmix_unit(req.params.seed, len(req.output)) >= probability:
            return row
    return reference_xtc(row, args[XTC_THRESHOLD])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_xtc_matches_the_reference_under_continuous_batching(seed: int) -> None:
    vocab = 24
    xtc = build(XtcLogitsProcessor, vocab)
    changed = run_batch(
        xtc, lambda rng: xtc_request(rng, vocab), xtc_expected, vocab=vocab, steps=200, seed=seed
    )
    assert changed > 50


def test_xtc_seeded_draws_depend_on_the_seed_and_step_only() -> None:
    draws = [splitmix_unit(7, k) for k in range(2000)]
    assert all(0.0 <= d < 1.0 for d in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.03
    assert draws[:5] == [splitmix_unit(7, k) for k in range(5)]
    assert draws[:5] != [splitmix_unit(8, k) for k in range(5)]
    # A seeded request decides the same alone and beside others, in any row.
    extra = {XTC_THRESHOLD: 0.05, XTC_PROBABILITY: 0.5}
    acted: list[list[bool]] = []
    for rows in (1, 4):
        xtc = build(XtcLogitsProcessor, 8)
        req = Request(SamplingParams(extra_args=extra, seed=11), [1], budget=0)
        others = [Request(SamplingParams(extra_args=extra), [1], budget=0) for _ in range(rows)]
        added = [(i, r.params, r.prompt, r.output) for i, r in enumerate(others)]
        added[-1] = (rows - 1, req.params, req.prompt, req.output)
        xtc.update_state(BatchUpdate(rows, [], added, []))
        seen = []
        for _ in range(40):
            logits = torch.zeros(rows, 8)
            logits[:, :3] = 2.0  # three top choices
            xtc.apply(logits)
            seen.append(bool(torch.isinf(logits[rows - 1]).any()))
            req.output.append(0)
        acted.append(seen)
    assert acted[0] == acted[1] and 5 < sum(acted[0]) < 35


def test_unseeded_xtc_uses_torchs_generator_at_its_probability() -> None:
    xtc = build(XtcLogitsProcessor, 8)
    params = SamplingParams(extra_args={XTC_THRESHOLD: 0.05, XTC_PROBABILITY: 0.3})
    xtc.update_state(BatchUpdate(1, [], [(0, params, [1], [])], []))

    def acts(n: int) -> list[bool]:
        out = []
        for _ in range(n):
            logits = torch.zeros(1, 8)
            logits[0, :3] = 2.0
            xtc.apply(logits)
            out.append(bool(torch.isinf(logits).any()))
        return out

    torch.manual_seed(3)
    first = acts(400)
    torch.manual_seed(3)
    assert acts(400) == first
    assert 0.22 < sum(first) / len(first) < 0.38


def test_xtc_keeps_the_least_likely_top_choice_and_leaves_single_ones() -> None:
    xtc = build(XtcLogitsProcessor, 5)
    params = SamplingParams(extra_args={XTC_THRESHOLD: 0.05, XTC_PROBABILITY: 1.0})
    xtc.update_state(BatchUpdate(2, [], [(0, params, [1], []), (1, params, [1], [])], []))
    # Row 0: p = 0.665, 0.245, 0.090, 0.0002: three top choices, the 0.090 one stays.
    # Row 1: p = 0.985, 0.005 x 3: one top choice, nothing to exclude.
    logits = torch.tensor([[3.0, 2.0, 1.0, -5.0, -INF], [6.0, 0.0, 0.0, 0.0, -INF]])
    xtc.apply(logits)
    assert logits[0].tolist() == [-INF, -INF, 1.0, -5.0, -INF]
    assert logits[1].tolist() == [6.0, 0.0, 0.0, 0.0, -INF]


def test_xtc_at_threshold_zero_never_keeps_a_masked_token() -> None:
    xtc = build(XtcLogitsProcessor, 4)
    params = SamplingParams(extra_args={XTC_THRESHOLD: 0.0, XTC_PROBABILITY: 1.0})
    xtc.update_state(BatchUpdate(1, [], [(0, params, [1], [])], []))
    logits = torch.tensor([[1.0, 2.0, -INF, 0.5]])
    xtc.apply(logits)
    assert logits[0].tolist() == [-INF, -INF, -INF, 0.5]


# -- banned strings ---------------------------------------------------------------------


def banned_request(rng: random.Random, vocab: int) -> Request:
    if rng.random() < 0.25:
        return Request(SamplingParams(), [rng.randrange(vocab)], budget=rng.randint(1, 30))
    sequences = [
        [rng.randrange(vocab) for _ in range(rng.choice([1, 2, 2, 3, 4]))]
        for _ in range(rng.randint(1, 5))
    ]
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
    extra = {BANNED_TOKEN_SEQUENCES: sequences}
    return Request(SamplingParams(extra_args=extra), prompt, budget=rng.randint(1, 30))


def banned_expected(req: Request, row: torch.Tensor) -> torch.Tensor:
    sequences = (req.params.extra_args or {}).get(BANNED_TOKEN_SEQUENCES)
    if not sequences:
        return row
    out = row.clone()
    for token in reference_banned(req.context, sequences):
        out[token] = -INF
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_banned_strings_match_the_reference_under_continuous_batching(seed: int) -> None:
    vocab = 6
    banned = build(BannedStringsLogitsProcessor, vocab)
    changed = run_batch(
        banned,
        lambda rng: banned_request(rng, vocab),
        banned_expected,
        vocab=vocab,
        steps=300,
        seed=seed,
    )
    assert changed > 100


def test_a_banned_sequence_never_ends_in_the_output() -> None:
    """The guarantee: greedy decoding pulled towards the banned sequences never completes
    one, not even one begun at the end of the prompt."""
    vocab = 10
    sequences = [[4], [1, 2, 3], [2, 5], [7, 7, 7]]
    banned = build(BannedStringsLogitsProcessor, vocab)
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        prompt = [1, 2] if trial % 2 else [7, 7]  # each begins a banned sequence
        req = Request(SamplingParams(extra_args={BANNED_TOKEN_SEQUENCES: sequences}), prompt, 0)
        banned.update_state(
            BatchUpdate(1, [0] if trial else [], [(0, req.params, prompt, req.output)], [])
        )
        for _ in range(60):
            logits = torch.randn(1, vocab, generator=gen)
            # Pull towards what would complete a banned sequence.
            logits[0, [3, 4, 5, 7]] += 4.0
            banned.apply(logits)
            req.output.append(int(logits[0].argmax()))
        context = req.context
        for seq in sequences:
            m = len(seq)
            ends = [
                i
                for i in range(len(prompt), len(context))
                if context[max(0, i - m + 1) : i + 1] == seq
            ]
            assert not ends, (seq, context)


def test_tokens_beyond_the_vocabulary_are_dropped() -> None:
    banned = build(BannedStringsLogitsProcessor, 4)
    params = SamplingParams(extra_args={BANNED_TOKEN_SEQUENCES: [[9], [1, 9], [2]]})
    banned.update_state(BatchUpdate(1, [], [(0, params, [1], [])], []))
    logits = torch.zeros(1, 4)
    banned.apply(logits)  # no IndexError: 9 is beyond the logits
    assert logits[0].tolist() == [0.0, 0.0, -INF, 0.0]


# -- all three --------------------------------------------------------------------------


def test_requests_without_the_fields_cost_nothing_and_stay_bitwise_equal() -> None:
    processors = [
        build(cls, 16)
        for cls in (BannedStringsLogitsProcessor, DryLogitsProcessor, XtcLogitsProcessor)
    ]
    plain: list[Any] = [(i, SamplingParams(temperature=0.7), [1, 2, 1, 2], []) for i in range(4)]
    for p in processors:
        p.update_state(BatchUpdate(4, [], plain, []))
        assert p.states == {}
        logits = torch.randn(4, 16)
        before = logits.clone()
        assert p.apply(logits) is logits and torch.equal(logits, before)
        assert p.is_argmax_invariant() is False


def test_a_removed_or_replaced_request_leaves_no_state() -> None:
    dry = build(DryLogitsProcessor, 8)
    on = SamplingParams(extra_args={DRY_MULTIPLIER: 1.0})
    dry.update_state(BatchUpdate(2, [], [(0, on, [1, 1], []), (1, on, [1, 1], [])], []))
    assert set(dry.states) == {0, 1}
    # Row 0 freed and refilled by a request without DRY; row 1 removed.
    dry.update_state(BatchUpdate(1, [1], [(0, SamplingParams(), [1], [])], []))
    assert dry.states == {}


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({DRY_MULTIPLIER: -1.0}, "dry_multiplier"),
        ({DRY_MULTIPLIER: "1"}, "dry_multiplier"),
        ({DRY_MULTIPLIER: 1.0, DRY_BASE: 1.0}, "dry_base"),
        ({DRY_MULTIPLIER: 1.0, DRY_ALLOWED_LENGTH: 0}, "dry_allowed_length"),
        ({DRY_MULTIPLIER: 1.0, DRY_ALLOWED_LENGTH: 2.0}, "dry_allowed_length"),
        ({DRY_MULTIPLIER: 1.0, DRY_PENALTY_LAST_N: -2}, "dry_penalty_last_n"),
        ({DRY_MULTIPLIER: 1.0, DRY_BREAKER_IDS: [-1]}, "dry_breaker_ids"),
        ({DRY_MULTIPLIER: math.nan}, "dry_multiplier"),
        ({XTC_PROBABILITY: 1.5}, "xtc_probability"),
        ({XTC_PROBABILITY: 0.5, XTC_THRESHOLD: 0.7}, "xtc_threshold"),
        ({BANNED_TOKEN_SEQUENCES: [[]]}, "banned_token_sequences"),
        ({BANNED_TOKEN_SEQUENCES: "x"}, "banned_token_sequences"),
        ({BANNED_TOKEN_SEQUENCES: [[1, True]]}, "banned_token_sequences"),
    ],
)
def test_vllm_refuses_bad_arguments_at_admission(extra: dict[str, Any], problem: str) -> None:
    """vLLM's frontend runs validate_params of the registered processors for every request
    (vllm/v1/sample/logits_processor/__init__.py): a 400 before the engine core."""
    with pytest.raises(VLLMValidationError, match=problem):
        validate_logits_processors_parameters(SAMPLER_PROCESSORS, SamplingParams(extra_args=extra))
    good = SamplingParams(
        extra_args={
            DRY_MULTIPLIER: 0.8,
            DRY_BREAKER_IDS: [1, 2],
            XTC_PROBABILITY: 0.5,
            BANNED_TOKEN_SEQUENCES: [[1, 2]],
        }
    )
    validate_logits_processors_parameters(SAMPLER_PROCESSORS, good)


def test_a_bad_argument_past_admission_drops_the_sampler_not_the_step() -> None:
    dry = build(DryLogitsProcessor, 8)
    bad = SamplingParams(extra_args={DRY_MULTIPLIER: 1.0, DRY_BASE: 0.5})
    dry.update_state(BatchUpdate(1, [], [(0, bad, [1], [])], []))
    assert dry.states == {}


# -- registration: what vLLM builds from the engine arguments -----------------------------


def test_vllm_builds_the_processors_from_the_engine_arguments() -> None:
    """vLLM's own V1 loader (build_logitsprocs, what the V1 model runner calls) turns the
    names the workers register into instances, after its built-in ones, in our order."""
    from vllm.v1.sample.logits_processor import build_logitsprocs

    config = EngineConfig(device="cpu")
    names = config.engine_kwargs("m", samplers=True)["logits_processors"]
    vllm_config = SimpleNamespace(
        speculative_config=None,
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        model_config=SimpleNamespace(get_vocab_size=lambda: 32),
    )
    built = build_logitsprocs(vllm_config, torch.device("cpu"), False, False, names)  # type: ignore[arg-type]
    ours = [type(p) for p in built.non_argmax_invariant][-3:]
    assert ours == [BannedStringsLogitsProcessor, DryLogitsProcessor, XtcLogitsProcessor]


def test_engine_kwargs_register_the_samplers_where_vllm_runs_them() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    assert "logits_processors" in {f.name for f in dataclasses.fields(EngineArgs)}
    cpu = EngineConfig(device="cpu")
    kwargs = cpu.engine_kwargs("m", charserve_scheduler=True, samplers=True)
    assert kwargs["logits_processors"] == list(SAMPLER_PROCESSORS)
    AsyncEngineArgs(**kwargs)  # vLLM takes the keyword (nothing starts)
    assert "logits_processors" not in cpu.engine_kwargs("m")  # bare vLLM references
    own = EngineConfig(device="cpu", engine_args={"logits_processors": ["pkg.mod:Mine"]})
    assert own.engine_kwargs("m", samplers=True)["logits_processors"] == [
        "pkg.mod:Mine",
        *SAMPLER_PROCESSORS,
    ]
    # CUDA: vLLM 0.32's Model Runner V2 refuses V1 processors; speculative decoding refuses
    # custom processors altogether.
    gpu = EngineConfig(device="cuda")
    assert not gpu.runs_samplers() and "logits_processors" not in gpu.engine_kwargs(
        "m", samplers=True
    )
    spec = EngineConfig(
        device="cpu",
        engine_args={"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
    )
    assert not spec.runs_samplers()


def test_the_gateways_bounds_are_the_samplers() -> None:
    assert schemas.MAX_DRY_ALLOWED_LENGTH == DRY_MAX_MATCH
    assert schemas.MAX_XTC_THRESHOLD == XTC_MAX_THRESHOLD
    assert set(ROLEPLAY_SAMPLING_FIELDS) <= set(schemas.SamplingRequest.model_fields)


# -- the worker's half: fields -> extra_args ----------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def tokens(tokenizer: Any) -> SamplerTokens:
    return SamplerTokens(tokenizer)


def test_a_breaker_is_every_token_that_contains_it(tokenizer: Any, tokens: SamplerTokens) -> None:
    newline = tokens.breaker_ids(["\n"])
    texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    assert newline == [i for i, t in enumerate(texts) if "\n" in t]
    assert tokenizer.encode("\n\n", add_special_tokens=False)[0] in newline  # one token
    both = tokens.breaker_ids(["\n", ":"])
    assert set(newline) < set(both) and both == sorted(both)
    # A breaker no token contains: the token that ends it in running text.
    spanning = "Q~Zx"
    assert not any(spanning in t for t in texts)
    assert (
        tokens.breaker_ids([spanning])
        == tokenizer.encode("a" + spanning, add_special_tokens=False)[-1:]
    )


def test_a_banned_string_is_banned_as_written_and_after_a_space(
    tokenizer: Any, tokens: SamplerTokens
) -> None:
    def enc(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    assert tokens.banned_sequences(["Mira"]) == [enc("Mira"), enc(" Mira")]
    assert tokens.banned_sequences([" Mira", "Mira"]) == [enc(" Mira"), enc("Mira")]
    assert tokens.banned_sequences(["\nUser:"]) == [enc("\nUser:")]


def test_extra_args_from_the_jobs_fields(tokens: SamplerTokens) -> None:
    assert tokens.extra_args({}) == {}
    assert tokens.extra_args({"dry_multiplier": 0.0, "xtc_probability": 0.0}) == {}
    args = tokens.extra_args(
        {"dry_multiplier": 0.8, "dry_allowed_length": 3, "xtc_probability": 0.5}
    )
    assert args[DRY_MULTIPLIER] == 0.8 and args[DRY_ALLOWED_LENGTH] == 3
    assert DRY_BASE not in args  # the processor's default
    assert args[DRY_BREAKER_IDS] == tokens.breaker_ids(DEFAULT_DRY_SEQUENCE_BREAKERS)
    assert args[XTC_THRESHOLD] == DEFAULT_XTC_THRESHOLD and args[XTC_PROBABILITY] == 0.5
    assert (
        tokens.extra_args({"dry_multiplier": 1.0, "dry_sequence_breakers": []})[DRY_BREAKER_IDS]
        == []
    )
    banned = tokens.extra_args({"banned_strings": ["Mira"]})
    assert banned == {BANNED_TOKEN_SEQUENCES: tokens.banned_sequences(["Mira"])}
    # What the worker makes passes vLLM's admission check of the processors.
    validate_logits_processors_parameters(
        SAMPLER_PROCESSORS, SamplingParams(extra_args={**args, **banned})
    )


def test_a_tokenizer_without_batch_decode_works_too() -> None:
    class Letters:
        """One token per character of 'ab:\\n '."""

        alphabet = "ab:\n "

        def __len__(self) -> int:
            return len(self.alphabet)

        def decode(self, ids: list[int]) -> str:
            return "".join(self.alphabet[i] for i in ids)

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [self.alphabet.index(c) for c in text]

    tokens = SamplerTokens(Letters())
    assert tokens.breaker_ids(["\n", ":"]) == [2, 3]
    assert tokens.breaker_ids([":\n"]) == [3]  # spans two tokens: the one that ends it
    assert tokens.banned_sequences(["ab"]) == [[0, 1], [4, 0, 1]]


# -- the engine: which fields go where ----------------------------------------------------


def test_the_engine_splits_the_jobs_sampling_fields() -> None:
    sampling = {
        "temperature": 0.7,
        "dry_multiplier": 0.8,
        "dry_sequence_breakers": ["\n"],
        "xtc_probability": 0.5,
        "banned_strings": ["x"],
        "top_k": None,
    }
    assert sampling_kwargs(sampling) == {"temperature": 0.7}
    assert roleplay_fields(sampling) == {
        "dry_multiplier": 0.8,
        "dry_sequence_breakers": ["\n"],
        "xtc_probability": 0.5,
        "banned_strings": ["x"],
    }
    SamplingParams(**sampling_kwargs(sampling))  # nothing vLLM does not know


async def test_a_replica_without_the_processors_refuses_what_asks_for_them(
    tokens: SamplerTokens,
) -> None:
    engine = VllmEngine.__new__(VllmEngine)  # no vLLM engine: only the mapping runs
    engine._sampler_tokens = None
    with pytest.raises(InvalidJobError, match="xtc_probability is not supported"):
        await engine._roleplay_args({"xtc_probability": 0.5, "xtc_threshold": 0.1})
    # Neutral values ask for nothing: served anywhere.
    assert await engine._roleplay_args({"dry_multiplier": 0.0, "xtc_threshold": 0.2}) == {}
    engine._sampler_tokens = tokens
    args = await engine._roleplay_args({"banned_strings": ["Mira"]})
    assert args == {BANNED_TOKEN_SEQUENCES: tokens.banned_sequences(["Mira"])}
