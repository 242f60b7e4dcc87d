"""vLLM's ``AsyncLLM`` behind the :class:`~workers.engines.base.Engine` protocol: what
production always runs (continuous batching, prefix caching, priority scheduling).

The gateway applies the chat template and sends token ids, so the engine skips
tokenisation; vLLM still detokenises incrementally and hands back text deltas.

The jobs of one claim are handed to vLLM's engine core together (:class:`CoreHandOff`), so
a wave of requests starts in one engine step.

LoRA adapters (``engine.lora_adapters``) are loaded by :meth:`VllmEngine.load_adapters`
when the replica starts, so no request pays for a load; a job whose model is one of their
names runs with it (the queue gives such a job only to a replica that loaded it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import structlog

from cluster.runtime.introspect import missing_names
from cluster.wire.protocol import ROLEPLAY_SAMPLING_FIELDS, SAMPLING_FIELDS, Job
from cluster.wire.turns import Call, TurnBatch
from workers.engines.base import EngineOutput
from workers.engines.config import EngineConfig
from workers.errors import InvalidJobError

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine import EngineCoreRequest

    from workers.engines.samplers import SamplerTokens

log = structlog.get_logger(__name__)


def sampling_kwargs(sampling: dict[str, Any]) -> dict[str, Any]:
    """The subset of a job's sampling fields that vLLM's ``SamplingParams`` accepts (the
    roleplay samplers' fields are :func:`roleplay_fields`)."""
    return {
        k: v
        for k, v in sampling.items()
        if k in SAMPLING_FIELDS and k not in ROLEPLAY_SAMPLING_FIELDS and v is not None
    }


def roleplay_fields(sampling: dict[str, Any]) -> dict[str, Any]:
    """A job's DRY, XTC and banned-strings fields, for the logits processors of
    :mod:`workers.engines.samplers` (through ``SamplingParams.extra_args``)."""
    return {k: v for k, v in sampling.items() if k in ROLEPLAY_SAMPLING_FIELDS and v is not None}


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


class CoreHandOff:
    """Sends the requests added in one turn of the replica's loop to vLLM's engine core
    together, at the turn's end.

    A claim's jobs each start a task, and each task prepares its request (vLLM's input
    and output processors, about 0.3 ms of this loop a job) and sends it at once. The
    engine core starts a step whenever it is free, with the requests that have arrived:
    31 jobs of one claim, spread over the 10 ms their preparation took, were split across
    two steps in about half of the waves (the second part's prefill then stalls every
    other stream for a step). Sent together, they arrive within the time of their sends
    alone, and start in one step.

    A job cancelled before the send (its client left) is never sent: its abort, already
    on its way, would otherwise reach the engine core before it, and leave it running.
    """

    def __init__(self, client: Any) -> None:
        self._add = client.add_request_async
        self._turn: TurnBatch[EngineCoreRequest] = TurnBatch(self._send)
        client.add_request_async = self.add

    @staticmethod
    def applies_to(llm: Any) -> bool:
        """True when ``llm`` (vLLM's ``AsyncLLM``) adds its requests through its engine
        core client's ``add_request_async``, which this hand-off stands in for."""
        return not missing_names(type(llm)._add_request, ["add_request_async"]) and hasattr(
            llm.engine_core, "add_request_async"
        )

    async def add(self, request: EngineCoreRequest) -> None:
        """Send ``request`` with the turn's others (the client's ``add_request_async``)."""
        await self._turn.call(request)

    async def _send(self, calls: list[Call[EngineCoreRequest]]) -> None:
        for call in calls:
            if call.left:
                continue
            try:
                await self._add(call.item)
            except Exception as exc:  # the engine core is gone: each caller learns it
                call.answer(exc)
            else:
                call.answer(None)


class VllmEngine:
    """vLLM's ``AsyncLLM`` behind the :class:`Engine` protocol."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        # vLLM is imported here only, so the rest of charserve never pays for it.
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        started = time.monotonic()
        self._config = config
        # Checked before the engine starts: a missing adapter fails the replica at once.
        self._adapter_paths = config.adapter_paths()
        self._loras: dict[str, LoRARequest] = {}
        engine_args = AsyncEngineArgs(
            **config.engine_kwargs(model_path, charserve_scheduler=True, samplers=True)
        )
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
        if CoreHandOff.applies_to(self._llm):
            CoreHandOff(self._llm.engine_core)
        else:
            log.warning(
                "vLLM's AsyncLLM no longer adds requests through add_request_async: "
                "a claim's jobs reach the engine core one by one"
            )
        # The roleplay samplers' strings become token ids here, in the replica, never in
        # the engine core's step loop (None: the processors are not registered).
        self._sampler_tokens: SamplerTokens | None = None
        if config.runs_samplers():
            from workers.engines.samplers import SamplerTokens

            self._sampler_tokens = SamplerTokens(self._llm.get_tokenizer())
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

    @property
    def adapters(self) -> frozenset[str]:
        return frozenset(self._loras)

    async def load_adapters(self) -> None:
        """Load every configured LoRA adapter into the engine (ids 1.. in name order)."""
        from vllm.lora.request import LoRARequest

        for lora_id, name in enumerate(sorted(self._adapter_paths), start=1):
            request = LoRARequest(name, lora_id, str(self._adapter_paths[name]))
            started = time.monotonic()
            if not await self._llm.add_lora(request):
                raise RuntimeError(f"vLLM did not load LoRA adapter {name!r}")
            self._loras[name] = request
            log.info(
                "lora adapter loaded",
                adapter=name,
                path=request.lora_path,
                load_s=round(time.monotonic() - started, 2),
            )

    @property
    def honours_seed(self) -> bool:
        # vLLM's CPU build kills the engine on a seeded request whose prefill is chunked.
        return self._config.device != "cpu"

    async def generate(self, job: Job, priority: int) -> AsyncIterator[EngineOutput]:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        prompt_ids = [*job.prompt_token_ids, *job.resume_token_ids]
        try:
            kwargs = sampling_kwargs(job.sampling)
            if not self.honours_seed and kwargs.get("seed") is not None:
                # vLLM's CPU build kills the whole engine ("CPU Generator does not use
                # offset") when a seeded request's prefill is chunked: a seed from one
                # client must not take the replica down, and must not be dropped silently.
                raise InvalidJobError(
                    "seed is not supported on the CPU engine (vLLM's CPU sampler fails on "
                    "a seeded request whose prefill is chunked); leave it out, or use a GPU "
                    "replica"
                )
            constraint = kwargs.pop("structured_outputs", None)
            if constraint is not None:
                from vllm.sampling_params import StructuredOutputsParams

                kwargs["structured_outputs"] = StructuredOutputsParams(**constraint)
            extra_args = await self._roleplay_args(roleplay_fields(job.sampling))
            if extra_args:
                kwargs["extra_args"] = extra_args
            params = SamplingParams(
                **kwargs,
                max_tokens=job.max_tokens - len(job.resume_token_ids),
                output_kind=RequestOutputKind.DELTA,
            )
            # Rendered here, on the loop: vLLM processes a raw prompt on its renderer's
            # thread pool (a raw prompt may need tokenizing), and that hop put a thread
            # handoff and a wake of this loop in front of every job's first step. Token
            # ids need no tokenizing; the rendered input is processed synchronously.
            (prompt,) = self._llm.renderer.render_cmpl([TokensPrompt(prompt_token_ids=prompt_ids)])
        except (TypeError, ValueError, VLLMClientError) as exc:
            raise InvalidJobError(str(exc)) from exc
        # vLLM's own request span joins the job's trace, when vLLM exports traces (it
        # warns on every request given headers it cannot use).
        traced = job.traceparent and self._config.engine_args.get("otlp_traces_endpoint")
        stream = self._llm.generate(
            prompt,
            params,
            job.id,
            priority=priority,
            lora_request=self._loras.get(job.model),
            trace_headers={"traceparent": job.traceparent} if traced else None,
        )
        try:
            # vLLM validates a request (a structured-output schema, say) as it is added,
            # which happens on the first step of this generator: that is the job's fault.
            first = await anext(stream)
        except (ValueError, VLLMClientError) as exc:
            raise InvalidJobError(str(exc)) from exc
        except StopAsyncIteration:
            return
        top = kwargs.get("logprobs")
        async for out in _chain(first, stream):
            completion = out.outputs[0]
            token_ids = list(completion.token_ids)
            yield EngineOutput(
                text=completion.text,
                token_ids=token_ids,
                finish_reason=completion.finish_reason,
                prompt_tokens=len(job.prompt_token_ids),
                cached_tokens=out.num_cached_tokens or 0,
                logprobs=None
                if top is None
                else token_logprobs(token_ids, completion.logprobs, top),
            )

    async def _roleplay_args(self, fields: dict[str, Any]) -> dict[str, Any]:
        """``extra_args`` for the roleplay samplers' processors; InvalidJobError when the
        job asks for one and this replica's engine does not run them."""
        if not fields:
            return {}
        from workers.engines.samplers import active_fields

        asked = active_fields(fields)
        if self._sampler_tokens is None:
            if asked:
                raise InvalidJobError(
                    f"{asked[0]} is not supported by this replica: the roleplay samplers "
                    "are vLLM V1 logits processors, which run on the CPU engine without "
                    "speculative decoding (vLLM's GPU engine runs Model Runner V2, which "
                    "does not load them)"
                )
            return {}
        if not asked:
            return {}
        # Off the event loop: the first DRY request decodes the whole vocabulary once.
        return await asyncio.to_thread(self._sampler_tokens.extra_args, fields)

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    async def check_health(self) -> None:
        await self._llm.check_health()

    def shutdown(self) -> None:
        self._llm.shutdown()


def token_logprobs(token_ids: list[int], steps: Any, top: int) -> list[Any]:
    """vLLM's sample logprobs (one ``{token id: Logprob}`` per new token) as a chunk carries
    them: ``[text, logprob, [[alternative, logprob], ...]]``, the ``top`` best first."""
    out: list[Any] = []
    for token_id, step in zip(token_ids, steps or [], strict=False):
        chosen = step.get(token_id)
        ranked = sorted(
            (lp for lp in step.values() if lp.rank is not None and lp.rank <= top),
            key=lambda lp: lp.rank,
        )
        out.append(
            [
                (chosen.decoded_token or "") if chosen else "",
                float(chosen.logprob) if chosen else float("-inf"),
                [[lp.decoded_token or "", float(lp.logprob)] for lp in ranked[:top]],
            ]
        )
    return out


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``first``, then the rest of ``rest``."""
    yield first
    async for item in rest:
        yield item
