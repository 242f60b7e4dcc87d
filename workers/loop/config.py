"""The knobs of a replica's loop, validated once: the Serve application's args extend them
(:class:`workers.deployment.WorkerArgs`), so every field is declared here only."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from cluster.wire.queue import QueuePolicy
from cluster.wire.replylog import REPLY_LOG_MAXLEN, REPLY_LOG_TTL_S


class ConsumerConfig(BaseModel):
    """Knobs of a consumer (a typo in a Serve config fails the deploy)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lease_ms: int = Field(default=5_000, ge=100, description="Claim lease length.")
    heartbeat_ms: int = Field(
        default=1_000,
        ge=50,
        description="Heartbeat and lease-renewal period; gateways judge a worker alive for "
        "three of them (keep CHARSERVE_HEARTBEAT_MS the same).",
    )
    publish_interval_ms: float = Field(
        default=0.0,
        ge=0.0,
        description="Coalesce later tokens of one request for up to this long (0: send "
        "whatever accumulated while the previous publish was in flight).",
    )
    queue_policy: QueuePolicy = Field(
        default="edf", description="edf: earliest deadline first; fifo: arrival order."
    )
    reply_log_ttl_s: int = Field(
        default=REPLY_LOG_TTL_S,
        ge=1,
        description="How long a reply can be resumed (its log lives); the gateways' "
        "CHARSERVE_REPLY_LOG_TTL_S, filled in by `charserve up` and `charserve deploy`.",
    )
    reply_log_max_chunks: int = Field(
        default=REPLY_LOG_MAXLEN,
        ge=16,
        description="Chunks a reply log keeps; at least the longest reply the engine can "
        "produce (the Serve args raise it to engine.max_model_len), so any reply can be "
        "resumed from its start.",
    )
    drain_timeout_s: float = Field(
        default=30.0, ge=0, description="How long a stopping replica lets replies finish."
    )
    claim_ahead: int = Field(
        default=0,
        ge=0,
        le=8,
        description="Jobs claimed beyond the engine's batch slots, waiting in the engine's "
        "own queue, so a slot freed at the end of a step is refilled in the next step "
        "instead of a step later (the claim's round trip misses the step that started).",
    )
    batch_reserve_slots: int = Field(
        default=4,
        ge=0,
        description="Slots batch work may never take, so interactive work always finds one.",
    )
    batch_reserve_min: int | None = Field(
        default=None,
        ge=0,
        description="Adaptive reserve: follow the latency-bound jobs in flight (their "
        "peak over batch_reserve_window_s, plus 2) between this and batch_reserve_slots.",
    )
    batch_reserve_window_s: float = Field(default=30.0, gt=0)
    max_attempts: int = Field(
        default=3,
        ge=1,
        description="A job is dead-lettered when this many workers in a row failed it.",
    )
    batch_starts_per_s: float = Field(
        default=8.0,
        ge=0,
        description="Batch jobs start at most this often (0: unpaced), so their prefills "
        "do not arrive in waves that stall interactive work (workers.loop.pacing).",
    )
    batch_start_burst: int = Field(default=2, ge=1)
