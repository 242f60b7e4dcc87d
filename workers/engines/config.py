"""Engine settings, in one place for the workers and for vLLM's own OpenAI server.

The CPU and GPU paths are one code path: ``device`` and a few sizes differ, nothing else.
The same :class:`EngineConfig` renders vLLM's ``AsyncEngineArgs`` (for the workers) and the
``vllm.entrypoints.openai.api_server`` command line (for side-by-side benchmarks), so a
comparison always runs both on identical engine settings.

Settings charserve depends on are typed fields. Every other vLLM ``EngineArgs`` keyword
(quantization, the KV cache dtype, speculative decoding, LoRA, ``trust_remote_code``, ...)
passes through ``engine_args``, checked against the installed vLLM's own ``EngineArgs``
when the config is built, so a typo fails the deploy instead of a replica's start.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import re
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.wire.vocabulary import ADAPTER_NAME_PATTERN, MAX_ADAPTERS

# How EngineConfig.batch_prefill_tokens reaches the scheduler in vLLM's engine core process.
BATCH_PREFILL_ENV = "CHARSERVE_BATCH_PREFILL_TOKENS"
# How EngineConfig.engine_core_spin reaches it (workers/engines/engine_wait.py reads it).
SPIN_ENV = "CHARSERVE_ENGINE_CORE_SPIN"
# How EngineConfig.engine_core_nice reaches it (workers/engines/engine_wait.py reads it).
NICE_ENV = "CHARSERVE_ENGINE_CORE_NICE"
# The engine core's nice value when it polls (does not spin) and the config says none.
POLLING_ENGINE_CORE_NICE = -10

# The roleplay samplers (DRY, XTC, banned strings: workers/engines/samplers.py), as vLLM's
# ``logits_processors`` engine argument takes them (``module:Class``), in the order vLLM
# applies them. Names only: this module does not import vLLM or torch.
SAMPLER_PROCESSORS = (
    "workers.engines.samplers:BannedStringsLogitsProcessor",
    "workers.engines.samplers:DryLogitsProcessor",
    "workers.engines.samplers:XtcLogitsProcessor",
)

# Typed EngineConfig fields that are vLLM EngineArgs keywords of the same name.
_TYPED_ENGINE_ARGS = (
    "model",
    "served_model_name",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enforce_eager",
    "enable_prefix_caching",
    "dtype",
    "tensor_parallel_size",
    "distributed_executor_backend",
    "gpu_memory_utilization",
    "seed",
)
# EngineArgs keywords engine_args may not set, and why: one way to set a thing, and what
# charserve relies on (the priority its deadlines ride on, its scheduler hook, the sizes
# the gateway checks prompts against) is not overridden behind its back.
OWNED_ENGINE_ARGS: dict[str, str] = {
    **{name: f"it is a typed field: set engine.{name}" for name in _TYPED_ENGINE_ARGS},
    "scheduling_policy": "charserve always runs vLLM's 'priority' policy (requests "
    "carry their deadline as their priority)",
    "scheduler_cls": "charserve sets it: engine.latency_first_steps chooses the scheduler",
}

# vLLM 0.32 declares these EngineArgs flags ``store_true``: there is no ``--no-`` form, and
# false is their default, so false renders as no flag at all.
_STORE_TRUE_FLAGS = frozenset(
    {"disable_log_stats", "aggregate_engine_logging", "data_parallel_multi_port_external_lb"}
)


@dataclasses.dataclass(frozen=True)
class _VllmArgs:
    """What the engine_args check reads from the installed vLLM."""

    version: str
    annotations: dict[str, Any]  # EngineArgs field -> its annotation
    nested: dict[str, tuple[str, frozenset[str]]]  # dict-valued field -> (class, its fields)


def _members(annotation: Any) -> list[Any]:
    """The types an annotation admits, through ``Annotated``, ``Union`` and ``X | Y``."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _members(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return [member for arg in get_args(annotation) for member in _members(arg)]
    return [annotation]


def _init_fields(cls: Any) -> frozenset[str]:
    """The constructor's keyword arguments of a (pydantic or standard) dataclass."""
    return frozenset(f.name for f in dataclasses.fields(cls) if f.init)


def _vllm_args() -> _VllmArgs | None:
    """vLLM's ``EngineArgs`` as the check needs it, or None when vLLM cannot be imported."""
    try:
        # Imported here, not at the top: the gateway-only install has no vLLM, and the
        # import takes seconds that only a config with engine_args needs to spend.
        import vllm
        from vllm.config import SpeculativeConfig
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return None
    annotations = {f.name: f.type for f in dataclasses.fields(EngineArgs)}
    nested: dict[str, tuple[str, frozenset[str]]] = {}
    for name, annotation in annotations.items():
        classes = [
            m for m in _members(annotation) if isinstance(m, type) and dataclasses.is_dataclass(m)
        ]
        if len(classes) == 1:  # e.g. compilation_config: EngineArgs builds it from a dict
            nested[name] = (classes[0].__name__, _init_fields(classes[0]))
    # Annotated as a plain dict in EngineArgs; vLLM builds a SpeculativeConfig from it.
    nested["speculative_config"] = (SpeculativeConfig.__name__, _init_fields(SpeculativeConfig))
    return _VllmArgs(str(vllm.__version__), annotations, nested)


def _did_you_mean(name: str, known: frozenset[str] | dict[str, Any]) -> str:
    """`` (did you mean 'x'?)`` for the closest known names, or nothing."""
    close = difflib.get_close_matches(name, list(known), n=3)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _json_problem(value: Any, where: str) -> str | None:
    """Why ``value`` is not a JSON value (what a Serve config and vLLM's CLI carry)."""
    if value is None or isinstance(value, bool | int | float | str):
        return None
    if isinstance(value, list):
        for i, item in enumerate(value):
            if (problem := _json_problem(item, f"{where}[{i}]")) is not None:
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where}: key {key!r} is not a string"
            if (problem := _json_problem(item, f"{where}.{key}")) is not None:
                return problem
        return None
    # YAML turns an unquoted 2024-01-01 into a date, for one.
    return f"{where}: a {type(value).__name__} is not a JSON value (quote it)"


_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _type_problem(value: Any, annotation: Any) -> str | None:
    """Why ``value`` cannot be what a simple annotation (bool, int, float, str or a
    Literal, or one of them or None) asks for; None when it can or the annotation is not
    that simple (vLLM checks the rest when the engine starts)."""
    if isinstance(annotation, str):  # a forward reference vLLM leaves unresolved
        return None
    members = _members(annotation)
    optional = type(None) in members
    kinds = [m for m in members if m is not type(None)]
    if len(kinds) != 1:
        return None
    kind = kinds[0]
    if value is None:
        return None if optional else "may not be null"
    if get_origin(kind) is Literal:
        choices = get_args(kind)
        # type() as well as ==: true == 1, but true is no LoRA rank.
        if any(value == c and type(value) is type(c) for c in choices):
            return None
        return f"is {value!r}, not one of {', '.join(repr(c) for c in choices)}"
    if kind is bool:
        fits = isinstance(value, bool)
    elif kind is int:
        fits = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        fits = isinstance(value, int | float) and not isinstance(value, bool)
    elif kind is str:
        fits = isinstance(value, str)
    else:
        return None
    return None if fits else f"is {value!r}, not {_KIND_NAMES[kind]}"


def _engine_arg_problem(key: str, value: Any, vllm: _VllmArgs | None) -> str | None:
    """What is wrong with one engine_args entry, or None."""
    if key in OWNED_ENGINE_ARGS:
        return f"{key!r} cannot be set in engine_args: {OWNED_ENGINE_ARGS[key]}"
    if key.startswith("_"):
        return f"{key!r} is internal to vLLM"
    if (problem := _json_problem(value, key)) is not None:
        return problem
    if vllm is None:
        return None
    if key not in vllm.annotations:
        return f"{key!r} is not an argument of vLLM {vllm.version}'s EngineArgs" + (
            _did_you_mean(key, vllm.annotations)
        )
    if (problem := _type_problem(value, vllm.annotations[key])) is not None:
        return f"{key} {problem}"
    if key in vllm.nested and isinstance(value, dict):
        cls_name, fields = vllm.nested[key]
        # vLLM's own parsing accepts kebab-case keys inside these dicts too.
        unknown = [k for k in value if k.replace("-", "_") not in fields]
        if unknown:
            return "; ".join(
                f"{key}: {k!r} is not a field of vLLM's {cls_name}{_did_you_mean(k, fields)}"
                for k in unknown
            )
    return None


def _cli_value(value: Any) -> str:
    """One command-line value: dicts as JSON (vLLM reads ``--speculative-config`` with
    ``json.loads`` and its config classes from JSON), the rest as text."""
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


def _cli_flags(name: str, value: Any) -> list[str]:
    """One engine_args entry as vLLM's argparse takes it."""
    flag = "--" + name.replace("_", "-")
    if value is None or value == []:
        return []  # neither has a command-line form: vLLM's default
    if isinstance(value, bool):
        if value:
            return [flag]
        return [] if name in _STORE_TRUE_FLAGS else [f"--no-{flag[2:]}"]
    if isinstance(value, list):
        return [flag, *(_cli_value(item) for item in value)]  # nargs="+"
    return [flag, _cli_value(value)]


class EngineConfig(BaseModel):
    """vLLM engine settings for one replica.

    The typed fields are the settings charserve relies on or chooses for vLLM;
    ``engine_args`` carries any other vLLM ``EngineArgs`` keyword as it is.
    """

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
    aot_compile: bool | None = Field(
        default=None,
        description="Compiled mode only: vLLM's ahead-of-time compilation "
        "(VLLM_USE_AOT_COMPILE). None: vLLM's default (on, with the installed torch). "
        "Off, every forward runs through Dynamo's dispatch: about 9% more per token at one "
        "stream on the CPU (docs/benchmarks.md); on, vLLM 0.32 on the CPU cannot load "
        "what it saved, so each start compiles again (about 20 to 40 s).",
    )
    engine_core_spin: bool | None = Field(
        default=None,
        description="With latency_first_steps: let vLLM's engine core spin while its model "
        "worker runs a step, as vLLM does (off: it polls with 0.2 ms sleeps, leaving the "
        "core to the gateway, the replica and Redis; workers/engines/engine_wait.py). "
        "None: spin on CUDA (cores to spare), sleep on the CPU.",
    )
    engine_core_nice: int | None = Field(
        default=None,
        ge=-20,
        le=19,
        description="With latency_first_steps: the nice value of vLLM's engine core "
        "process (its scheduler), set in that process at start; its model workers keep "
        "theirs. A polling engine core wakes every 0.2 ms for a moment's work, and each "
        "step waits for it: with a higher priority it does not wait behind the gateway, "
        "the replica and Redis on a busy core (workers/engines/engine_wait.py). A "
        "negative value needs CAP_SYS_NICE; without it the engine core keeps its "
        "priority and says so in the log. None: -10 when the engine core polls, "
        "unchanged when it spins (a spinning process given priority takes its core).",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other vLLM EngineArgs keyword, passed to vLLM as given "
        "(quantization, kv_cache_dtype, speculative_config, enable_lora, "
        "trust_remote_code, ...). Checked against the installed vLLM when the config is "
        "built; not where vLLM is not installed (the gateway-only install). Not the "
        "keywords the typed fields set.",
    )

    lora_adapters: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters this replica serves: name -> local folder in PEFT's "
        "format. A request whose model is a name here runs with that adapter, on a replica "
        "that loaded it. Needs engine_args.enable_lora; at most max_cpu_loras (else "
        "max_loras, vLLM's default 1) of them; loaded when the replica starts.",
    )

    @field_validator("lora_adapters")
    @classmethod
    def _check_adapter_names(cls, adapters: dict[str, str]) -> dict[str, str]:
        """Names a request can spell as its model; local paths (never a hub id)."""
        if len(adapters) > MAX_ADAPTERS:
            raise ValueError(f"at most {MAX_ADAPTERS} LoRA adapters per replica")
        for name, path in adapters.items():
            if not re.fullmatch(ADAPTER_NAME_PATTERN, name):
                raise ValueError(
                    f"LoRA adapter name {name[:80]!r} must match {ADAPTER_NAME_PATTERN}"
                )
            if not path or not Path(path).is_absolute():
                raise ValueError(
                    f"LoRA adapter {name!r}: {path!r} is not an absolute local path "
                    "(adapters are never downloaded at run time)"
                )
        return adapters

    @model_validator(mode="after")
    def _check_lora(self) -> EngineConfig:
        """An adapter needs LoRA on, a name apart from the base model's, and room."""
        if not self.lora_adapters:
            return self
        if self.engine_args.get("enable_lora") is not True:
            raise ValueError("lora_adapters needs engine_args.enable_lora: true")
        if self.served_model_name in self.lora_adapters:
            raise ValueError(
                f"LoRA adapter name {self.served_model_name!r} is the served model's name"
            )
        room = self.adapter_room()
        if len(self.lora_adapters) > room:
            raise ValueError(
                f"{len(self.lora_adapters)} LoRA adapters, but vLLM keeps at most {room} "
                "loaded (engine_args.max_cpu_loras, else max_loras): raise it"
            )
        return self

    def adapter_room(self) -> int:
        """How many adapters vLLM keeps loaded: ``max_cpu_loras``, else ``max_loras``
        (vLLM's default: 1)."""
        room = self.engine_args.get("max_cpu_loras") or self.engine_args.get("max_loras") or 1
        return int(room)

    def adapter_paths(self) -> dict[str, Path]:
        """The adapters' folders, checked to hold an adapter (at the replica's start: the
        machine that deploys may not have them)."""
        paths: dict[str, Path] = {}
        for name, path in self.lora_adapters.items():
            folder = Path(path)
            if not (folder / "adapter_config.json").is_file():
                raise ValueError(f"LoRA adapter {name!r}: {folder} has no adapter_config.json")
            paths[name] = folder
        return paths

    @field_validator("engine_args")
    @classmethod
    def _check_engine_args(cls, engine_args: dict[str, Any]) -> dict[str, Any]:
        """Refuse what vLLM would refuse at the engine's start, so a typo fails the deploy.

        Every key must be a field of vLLM's ``EngineArgs`` (the close ones are named when
        it is not), not one a typed field sets, with a JSON value; simple annotations
        (bool, int, float, str, a Literal) are checked, and so are the keys of dicts vLLM
        builds a config class from (``speculative_config``, ``compilation_config``, ...).
        vLLM is imported here, only when there is something to check; where it cannot be
        imported (the gateway-only install has no vLLM) only the checks that need no vLLM
        run, and the replica, which has vLLM, checks the rest when it builds this config.
        """
        vllm = _vllm_args() if engine_args else None
        problems = [
            problem
            for key, value in engine_args.items()
            if (problem := _engine_arg_problem(key, value, vllm)) is not None
        ]
        if problems:
            raise ValueError("; ".join(problems))
        return engine_args

    def executor_backend(self) -> str | None:
        """vLLM's ``distributed_executor_backend``, or None to let vLLM choose."""
        if self.distributed_executor_backend != "auto":
            return self.distributed_executor_backend
        if self.device == "cuda" and self.tensor_parallel_size > 1:
            # The replica actor holds no GPU itself (its placement group's bundles do), so
            # vLLM's own default (multiprocessing over local GPUs) would see none.
            return "ray"
        return None

    def runs_samplers(self) -> bool:
        """Whether the engine can run the roleplay samplers' logits processors.

        They implement vLLM's V1 logits-processor interface, which vLLM 0.32 loads for its
        V1 model runner only: the CPU build always runs that one (it has no Triton), but on
        CUDA vLLM 0.32 runs Model Runner V2 by default, whose loader refuses V1 processors
        at the engine's start (vllm/v1/worker/gpu/sample/logits_processor/loader.py).
        Nor does vLLM run custom logits processors beside speculative decoding: it refuses
        to start (vllm/v1/sample/logits_processor/__init__.py, build_logitsprocs).
        """
        return self.device == "cpu" and not self.engine_args.get("speculative_config")

    def engine_kwargs(
        self, model_path: str, *, charserve_scheduler: bool = False, samplers: bool = False
    ) -> dict[str, Any]:
        """Keyword arguments for ``vllm.engine.arg_utils.AsyncEngineArgs``.

        ``charserve_scheduler`` adds the latency-first scheduler (if enabled) and
        ``samplers`` the roleplay samplers' logits processors (where :meth:`runs_samplers`,
        after any ``logits_processors`` of ``engine_args``): the workers ask for both;
        references that stand for bare vLLM do not. ``engine_args`` come
        first (the validator keeps them apart from the typed fields), as a deep copy:
        vLLM writes into the dicts it is given (the target model into
        ``speculative_config``).
        """
        kwargs: dict[str, Any] = copy.deepcopy(self.engine_args)
        kwargs |= {
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
        if samplers and self.runs_samplers():
            own = [p for p in kwargs.get("logits_processors") or [] if p not in SAMPLER_PROCESSORS]
            kwargs["logits_processors"] = [*own, *SAMPLER_PROCESSORS]
        if self.device == "cuda":
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        backend = self.executor_backend()
        if backend is not None:
            kwargs["distributed_executor_backend"] = backend
        return kwargs

    def spins(self) -> bool:
        """Whether vLLM's engine core spins while its model worker runs a step."""
        if self.engine_core_spin is None:
            return self.device != "cpu"
        return self.engine_core_spin

    def core_nice(self) -> int | None:
        """The nice value for vLLM's engine core process (None: leave it as started)."""
        if self.engine_core_nice is not None:
            return self.engine_core_nice
        return None if self.spins() else POLLING_ENGINE_CORE_NICE

    def env(self) -> dict[str, str]:
        """Environment variables the engine process needs."""
        env = {
            "VLLM_CONFIGURE_LOGGING": "0",
            BATCH_PREFILL_ENV: str(self.batch_prefill_tokens),
            SPIN_ENV: "1" if self.spins() else "0",
        }
        nice = self.core_nice()
        if nice is not None:
            env[NICE_ENV] = str(nice)
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{self.kv_cache_space_gib:g}"
        if not self.enforce_eager and self.aot_compile is not None:
            env["VLLM_USE_AOT_COMPILE"] = "1" if self.aot_compile else "0"
        return env

    def server_args(self, model_path: str, host: str, port: int) -> list[str]:
        """Command-line flags for vLLM's own OpenAI server with the same settings.

        ``engine_args`` follow as vLLM's argparse reads them: ``--kebab-case value``,
        booleans as ``--flag`` / ``--no-flag``, lists as one argument per item, dicts as
        JSON (``--speculative-config '{"method": "ngram", ...}'``); a null or an empty
        list has no command-line form and leaves vLLM's default.
        """
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
        for name, value in self.engine_args.items():
            args += _cli_flags(name, value)
        if self.lora_adapters:
            args += ["--lora-modules", *(f"{n}={p}" for n, p in self.lora_adapters.items())]
        return args
