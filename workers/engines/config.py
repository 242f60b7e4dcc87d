"""Engine settings, in one place for the workers and for vLLM's own OpenAI server.

The CPU and GPU paths are one code path: ``device`` and a few sizes differ, nothing else.
The same :class:`EngineConfig` renders vLLM's ``AsyncEngineArgs`` (for the workers) and the
``vllm.entrypoints.openai.api_server`` command line (for side-by-side benchmarks), so a
comparison always runs both on identical engine settings.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# How EngineConfig.batch_prefill_tokens reaches the scheduler in vLLM's engine core process.
BATCH_PREFILL_ENV = "CHARSERVE_BATCH_PREFILL_TOKENS"


class EngineConfig(BaseModel):
    """vLLM engine settings for one replica."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, description="HF folder or id; None = bundled.")
    served_model_name: str = "smollm2-135m-instruct"
    device: Literal["cpu", "cuda"] = "cpu"
    max_model_len: int = Field(default=2048, ge=64)
    max_num_seqs: int = Field(default=32, ge=1, description="Batch slots per replica.")
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = Field(
        default=False,
        description="True: no torch.compile / CUDA graphs (faster start, slower tokens).",
    )
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description="GPUs one replica shards the model over. Above 1 the Serve config "
        "gives each replica a placement group with one GPU bundle per shard.",
    )
    distributed_executor_backend: Literal["auto", "ray", "mp", "uni"] = Field(
        default="auto",
        description="auto: 'ray' for tensor parallelism on CUDA (vLLM's workers are Ray "
        "actors in the replica's placement group), vLLM's own choice otherwise.",
    )
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    kv_cache_space_gib: float = Field(
        default=1.0, gt=0, description="CPU only: VLLM_CPU_KVCACHE_SPACE."
    )
    seed: int = 0
    latency_first_steps: bool = Field(
        default=True,
        description="Run an interactive prefill in a step without batch work "
        "(workers/engines/scheduler.py). Off: vLLM's own priority scheduler.",
    )
    batch_prefill_tokens: int = Field(
        default=256,
        ge=0,
        description="With latency_first_steps: prompt tokens a step carrying batch work may "
        "hold besides its decodes, which bounds the step an arriving interactive request "
        "waits behind (0: up to max_num_batched_tokens).",
    )

    def executor_backend(self) -> str | None:
        """vLLM's ``distributed_executor_backend``, or None to let vLLM choose."""
        if self.distributed_executor_backend != "auto":
            return self.distributed_executor_backend
        if self.device == "cuda" and self.tensor_parallel_size > 1:
            # The replica actor holds no GPU itself (its placement group's bundles do), so
            # vLLM's own default (multiprocessing over local GPUs) would see none.
            return "ray"
        return None

    def engine_kwargs(
        self, model_path: str, *, charserve_scheduler: bool = False
    ) -> dict[str, Any]:
        """Keyword arguments for ``vllm.engine.arg_utils.AsyncEngineArgs``.

        ``charserve_scheduler`` adds the latency-first scheduler (if enabled): the workers
        ask for it; references that stand for bare vLLM do not.
        """
        kwargs: dict[str, Any] = {
            "model": model_path,
            "served_model_name": [self.served_model_name],
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "enforce_eager": self.enforce_eager,
            "enable_prefix_caching": self.enable_prefix_caching,
            "dtype": self.dtype,
            "tensor_parallel_size": self.tensor_parallel_size,
            # Requests carry a deadline-derived priority (lower runs first).
            "scheduling_policy": "priority",
            "seed": self.seed,
        }
        if self.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        if charserve_scheduler and self.latency_first_steps:
            # One hook for both paths: it picks vLLM's synchronous or asynchronous
            # scheduler as vLLM resolved it (synchronous on the CPU).
            kwargs["scheduler_cls"] = "workers.engines.scheduler.latency_first_scheduler"
        if self.device == "cuda":
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        backend = self.executor_backend()
        if backend is not None:
            kwargs["distributed_executor_backend"] = backend
        return kwargs

    def env(self) -> dict[str, str]:
        """Environment variables the engine process needs."""
        env = {
            "VLLM_CONFIGURE_LOGGING": "0",
            BATCH_PREFILL_ENV: str(self.batch_prefill_tokens),
        }
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{self.kv_cache_space_gib:g}"
            if not self.enforce_eager:
                # vLLM 0.32's ahead-of-time compile artifacts fail to load on the CPU
                # ("'function' object has no attribute 'finalize_loading'"), so every start
                # compiled again (about 120 s here); torch.compile's own cache loads (64 s).
                env["VLLM_USE_AOT_COMPILE"] = "0"
        return env

    def server_args(self, model_path: str, host: str, port: int) -> list[str]:
        """Command-line flags for vLLM's own OpenAI server with the same settings."""
        args = [
            "--model",
            model_path,
            "--served-model-name",
            self.served_model_name,
            "--host",
            host,
            "--port",
            str(port),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--dtype",
            self.dtype,
            "--tensor-parallel-size",
            str(self.tensor_parallel_size),
            "--scheduling-policy",
            "priority",
            "--seed",
            str(self.seed),
            "--enable-prefix-caching"
            if self.enable_prefix_caching
            else "--no-enable-prefix-caching",
        ]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.device == "cuda":
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.distributed_executor_backend != "auto":
            args += ["--distributed-executor-backend", self.distributed_executor_backend]
        return args
