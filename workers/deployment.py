"""The Ray Serve deployment: one replica = one engine + one consumer loop.

Ray Serve owns the replica's lifecycle (placement with ``num_gpus``/``num_cpus``, health
checks, restarts, autoscaling, rolling updates); the replica itself takes no HTTP traffic.
It claims work from Redis and streams replies back over Redis, so any gateway can front
any replica. ``build_app(args)`` is the builder a Serve config names::

    applications:
      - name: charserve
        import_path: workers.deployment:build_app
        args: {engine: {...}, redis_url: ...}
"""

from __future__ import annotations

import os
from typing import Any, Literal

import structlog
from pydantic import Field, model_validator
from ray import serve
from ray.serve import Application

from cluster.runtime import gc_policy as heap
from cluster.runtime.bundled_model import resolve_model
from cluster.runtime.logs import configure_logging
from cluster.wire.keys import Keys
from workers.engines.base import Engine
from workers.engines.config import EngineConfig
from workers.engines.simulated import SimulatedConfig, SimulatedEngine
from workers.engines.vllm_engine import VllmEngine
from workers.loop.config import ConsumerConfig
from workers.loop.consumer import Consumer

log = structlog.get_logger(__name__)


class WorkerArgs(ConsumerConfig):
    """The ``args`` of the Serve application: the consumer's knobs plus the engine and
    where to find Redis (validated, so a typo fails the deploy)."""

    engine: EngineConfig = Field(default_factory=EngineConfig)
    engine_kind: Literal["vllm", "simulated"] = Field(
        default="vllm",
        description="simulated: the timing-model engine, for control-plane tests and "
        "benchmarks only; never for users.",
    )
    simulated: SimulatedConfig = Field(default_factory=SimulatedConfig)
    redis_url: str | None = Field(
        default=None, description="Redis the replicas claim from; None = $CHARSERVE_REDIS_URL."
    )
    namespace: str = "charserve"
    log_format: str = "json"
    log_level: str = "info"

    @model_validator(mode="after")
    def _logs_hold_the_longest_reply(self) -> WorkerArgs:
        # A reply has at most one chunk per token (plus its end, and what retries add).
        longest = self.engine.max_model_len + 64
        if self.reply_log_max_chunks < longest:
            object.__setattr__(self, "reply_log_max_chunks", longest)
        return self

    def resolved_redis_url(self) -> str:
        """The Redis URL from the args or the environment."""
        url = self.redis_url or os.environ.get("CHARSERVE_REDIS_URL")
        if not url:
            raise ValueError("no Redis: set args.redis_url or CHARSERVE_REDIS_URL")
        return url


def _build_engine(args: WorkerArgs) -> Engine:
    """The engine the args ask for; vLLM unless the simulator is named explicitly."""
    if args.engine_kind == "simulated":
        log.warning("using the SIMULATED engine: no model runs in this replica")
        return SimulatedEngine(args.simulated)
    os.environ.update(args.engine.env())
    return VllmEngine(args.engine, resolve_model(args.engine.model))


@serve.deployment(
    name="CharserveWorker",
    ray_actor_options={"num_cpus": 1},
    health_check_period_s=5,
    health_check_timeout_s=30,
    graceful_shutdown_timeout_s=60,
    max_ongoing_requests=4,
)
class WorkerReplica:
    """Hosts one engine and its consumer loop inside a Serve replica."""

    async def __init__(self, args: dict[str, Any]) -> None:  # type: ignore[misc]
        parsed = WorkerArgs.model_validate(args)
        configure_logging(parsed.log_level, parsed.log_format)
        self._engine = _build_engine(parsed)
        if isinstance(self._engine, VllmEngine):
            # Before the consumer starts: it advertises (and claims for) what is loaded.
            await self._engine.load_adapters()
        self._consumer = Consumer(
            parsed.resolved_redis_url(),
            Keys(parsed.namespace),
            self._engine,
            parsed,
        )
        await self._consumer.start()
        # Ray, the engine and this app live as long as the replica: keep them out of the
        # collector's full passes, which otherwise stall every stream's publishing.
        heap.settle()

    async def check_health(self) -> None:
        """Serve calls this periodically; raising makes Serve replace the replica."""
        await self._engine.check_health()
        if not self._consumer.alive:
            raise RuntimeError("consumer loop stopped")

    async def stats(self) -> dict[str, Any]:
        """Worker id and jobs running, for operators and tests."""
        return {"worker_id": self._consumer.worker_id, "running": self._consumer.running}

    async def __del__(self) -> None:
        """Graceful shutdown: stop claiming, finish in-flight work, stop the engine."""
        await self._consumer.close()
        self._engine.shutdown()


# Serve force-kills a stopping replica ``graceful_shutdown_timeout_s`` after asking it to
# stop. Its drain (``drain_timeout_s``), Serve's own wait loop before ``__del__`` and the
# hand-back of unfinished jobs must fit inside, or scale-down would cut replies off.
SHUTDOWN_MARGIN_S = 15.0


def graceful_shutdown_timeout_s(args: WorkerArgs) -> float:
    """The shortest graceful-shutdown timeout that lets a replica drain completely."""
    return args.drain_timeout_s + SHUTDOWN_MARGIN_S


def build_app(args: dict[str, Any]) -> Application:
    """Serve application builder named by ``ray-configs/*.yaml``."""
    parsed = WorkerArgs.model_validate(args)  # fail the deploy early on bad args
    # A deployment option in the Serve config still overrides this.
    timeout_s = max(60.0, graceful_shutdown_timeout_s(parsed))
    return WorkerReplica.options(  # type: ignore[attr-defined]
        graceful_shutdown_timeout_s=timeout_s
    ).bind(args)
