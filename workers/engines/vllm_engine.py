"""The engine a worker drives: a small :class:`Engine` protocol and its vLLM implementation.

The protocol is the seam between the consumer loop and the model. Production always uses
:class:`VllmEngine` (vLLM's ``AsyncLLM``: continuous batching, prefix caching, priority
scheduling); unit tests may inject a deterministic engine.

The gateway applies the chat template and sends token ids, so the engine skips
tokenisation; vLLM still detokenises incrementally and hands back text deltas.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from cluster.wire.protocol import Job
from workers.engines.config import EngineConfig
from workers.errors import InvalidJobError

log = structlog.get_logger(__name__)

# vLLM priorities at or above this are batch work (2**50 ms is ~35,000 years past any
# deadline); see workers/engines/scheduler.py.
BATCH_PRIORITY_BASE = 1 << 50


def engine_priority(job: Job) -> int:
    """vLLM priority of a job (lower runs first): its deadline in ms, EDF order, shifted
    past every latency-bound request if it is batch work."""
    if job.priority_class == "batch":
        return job.deadline_ms + BATCH_PRIORITY_BASE
    return job.deadline_ms


@dataclass(slots=True)
class EngineOutput:
    """One step's output for one request: the new text and tokens since the last one.

    Built once per request per engine step, and never changed after: not frozen only
    because a frozen dataclass costs twice as much to build (0.6 µs a token)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int = 0


class Engine(Protocol):
    """What a worker needs from a model engine."""

    @property
    def max_slots(self) -> int:
        """Requests the engine runs at once (its batch slots)."""
        ...

    def generate(self, job: Job, priority: int) -> AsyncIterator[EngineOutput]:
        """Stream the reply to ``job``; cancelling the iteration aborts the request."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a running request and free its slot."""
        ...

    async def check_health(self) -> None:
        """Raise if the engine is dead."""
        ...

    def shutdown(self) -> None:
        """Stop the engine and its processes."""
        ...


# Receives one request's outputs, in order, as the engine produces them. It must not block
# and should not raise: an engine calls it from its own step loop.
OutputSink = Callable[[EngineOutput], None]


class PushEngine(Engine, Protocol):
    """An engine that can hand outputs to a sink from its own step loop.

    With thousands of streams, waking one task per request per token (what iterating
    :meth:`Engine.generate` costs) is most of a worker's CPU. An engine that steps every
    request in one place (the simulator) can instead call each request's sink directly,
    so a request's task wakes only when its reply ends. vLLM's engine does not: its
    outputs arrive per request through ``AsyncLLM.generate`` anyway.
    """

    async def generate_into(self, job: Job, priority: int, sink: OutputSink) -> None:
        """Run ``job``, calling ``sink`` with each output; return once the reply ended.
        Cancelling the call aborts the request; an exception ``sink`` raises ends it,
        and is raised here."""
        ...


async def run_generation(engine: Engine, job: Job, priority: int, sink: OutputSink) -> None:
    """Run ``job`` on ``engine`` and hand every output to ``sink``: through the engine's
    push path when it has one (:class:`PushEngine`), else by iterating ``generate``.
    Either way the caller sees the same outputs in the same order, and cancellation and
    errors reach it the same way."""
    push = getattr(engine, "generate_into", None)
    if push is not None:
        await push(job, priority, sink)
        return
    async for out in engine.generate(job, priority):
        sink(out)


# Sampling fields a job may set; everything else vLLM's SamplingParams knows is either
# set here (max_tokens, output_kind) or internal.
_SAMPLING_FIELDS = frozenset(
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
    }
)


def sampling_kwargs(sampling: dict[str, Any]) -> dict[str, Any]:
    """The subset of a job's sampling fields that vLLM's ``SamplingParams`` accepts."""
    return {k: v for k, v in sampling.items() if k in _SAMPLING_FIELDS and v is not None}


def _replica_placement_group() -> Any:
    """The placement group the Serve replica runs in (its ``placement_group_bundles``)."""
    from ray.util import get_current_placement_group

    group = get_current_placement_group()
    if group is None:
        raise RuntimeError(
            "vLLM's Ray executor needs the replica's placement group: give the deployment "
            "placement_group_bundles with one GPU bundle per tensor-parallel shard"
        )
    return group


class VllmEngine:
    """vLLM's ``AsyncLLM`` behind the :class:`Engine` protocol."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        # vLLM is imported here only, so the rest of charserve never pays for it.
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        started = time.monotonic()
        self._config = config
        engine_args = AsyncEngineArgs(**config.engine_kwargs(model_path, charserve_scheduler=True))
        if config.executor_backend() == "ray":
            # vLLM's engine core runs in a child process, outside the replica's placement
            # group: hand the group over explicitly, or vLLM would ask Ray for a second
            # set of GPUs (this is what Ray Serve LLM does too).
            vllm_config = engine_args.create_engine_config()
            vllm_config.parallel_config.placement_group = _replica_placement_group()
            self._llm = AsyncLLM.from_vllm_config(
                vllm_config,
                enable_log_requests=engine_args.enable_log_requests,
                disable_log_stats=engine_args.disable_log_stats,
            )
        else:
            self._llm = AsyncLLM.from_engine_args(engine_args)
        log.info(
            "engine started",
            model=model_path,
            device=config.device,
            max_num_seqs=config.max_num_seqs,
            startup_s=round(time.monotonic() - started, 1),
        )

    @property
    def max_slots(self) -> int:
        return self._config.max_num_seqs

    async def generate(self, job: Job, priority: int) -> AsyncIterator[EngineOutput]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        prompt_ids = [*job.prompt_token_ids, *job.resume_token_ids]
        try:
            kwargs = sampling_kwargs(job.sampling)
            if self._config.device == "cpu" and kwargs.pop("seed", None) is not None:
                # vLLM's CPU build kills the whole engine ("CPU Generator does not use
                # offset") when a seeded request's prefill is chunked: a seed from one
                # client must not take the replica down, so CPU replicas ignore it.
                log.debug("seed ignored on the CPU engine", request_id=job.id)
            params = SamplingParams(
                **kwargs,
                max_tokens=job.max_tokens - len(job.resume_token_ids),
                output_kind=RequestOutputKind.DELTA,
            )
        except (TypeError, ValueError) as exc:
            raise InvalidJobError(str(exc)) from exc
        stream = self._llm.generate(
            TokensPrompt(prompt_token_ids=prompt_ids), params, job.id, priority=priority
        )
        async for out in stream:
            completion = out.outputs[0]
            yield EngineOutput(
                text=completion.text,
                token_ids=list(completion.token_ids),
                finish_reason=completion.finish_reason,
                prompt_tokens=len(job.prompt_token_ids),
                cached_tokens=out.num_cached_tokens or 0,
            )

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    async def check_health(self) -> None:
        await self._llm.check_health()

    def shutdown(self) -> None:
        self._llm.shutdown()
