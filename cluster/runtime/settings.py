"""Typed settings of the gateway and the ``charserve`` command (environment prefix
``CHARSERVE_``).

Settings are built once in each process's entry point (``Settings()``) and passed down;
nothing reads the environment at import time, so tests can build their own. Workers are
the other kind of process: their settings are the Serve application's args
(:class:`workers.deployment.WorkerArgs`), into which ``charserve up`` and ``charserve
deploy`` copy the few values both sides must share (:mod:`cluster.ops.serve_config`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from cluster.runtime.tracing import TracingMode
from cluster.wire.replylog import REPLY_LOG_TTL_S
from cluster.wire.tenants import AuthMode, Limits


class Settings(BaseSettings):
    """Everything an operator can set. Field names map to ``CHARSERVE_<NAME>``."""

    model_config = SettingsConfigDict(
        env_prefix="CHARSERVE_", extra="ignore", populate_by_name=True
    )

    # Where things are.
    redis_url: str | None = Field(
        default=None, description="Redis to use; unset in `charserve up` starts a local one."
    )
    redis_maxmemory_mb: int = Field(
        default=1024,
        ge=0,
        description="maxmemory of the Redis `charserve up` starts (noeviction: past it "
        "Redis refuses new work, answered 503, and drops nothing; 0: no bound).",
    )
    data_dir: str = Field(
        default="~/.local/share/charserve",
        description="Where `charserve up` keeps its Redis append-only file (and its URL).",
    )
    namespace: str = Field(default="charserve", description="Prefix of every Redis key.")
    host: str = Field(default="127.0.0.1", description="Gateway bind address.")
    port: int = Field(default=8000, ge=0, le=65535, description="Gateway port.")
    gateway_workers: int = Field(
        default=1, ge=1, description="Gateway processes `charserve gateway` (and `up`) runs."
    )

    # The model.
    model: str | None = Field(
        default=None, description="HF folder or id; unset uses the bundled SmolLM2-135M."
    )
    served_model_name: str = Field(
        default="smollm2-135m-instruct", description="Model name clients ask for."
    )
    max_model_len: int = Field(default=2048, ge=64, description="Context window in tokens.")
    default_max_tokens: int = Field(
        default=256, ge=1, description="max_tokens when a request leaves it out."
    )

    # Serving.
    serve_config: str = Field(
        default="ray-configs/local-cpu.yaml", description="Serve config `up` deploys."
    )
    heartbeat_ms: int = Field(
        default=1_000,
        ge=50,
        description="The workers' heartbeat period: a worker is alive for three of them.",
    )
    request_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Longest a gateway waits for a reply's first chunk, or between two "
        "chunks of it (504 or a timeout error event after that).",
    )
    budget_interactive_ms: int = Field(
        default=2_000, ge=1, description="TTFT budget of the interactive class."
    )
    budget_standard_ms: int = Field(
        default=30_000, ge=1, description="TTFT budget of the standard class."
    )
    budget_batch_ms: int = Field(
        default=86_400_000, ge=1, description="TTFT budget of the batch class (a day)."
    )
    admission_floor_ms: float = Field(
        default=10.0,
        ge=0,
        description="The least time to first token admission assumes, before any worker "
        "measured one: a budget below it is refused even on an idle cluster.",
    )
    max_queued: int = Field(
        default=10_000, ge=1, description="Hard bound on waiting jobs (protects Redis memory)."
    )
    queue_policy: Literal["edf", "fifo"] = Field(
        default="edf", description="edf: earliest deadline first; fifo: arrival order."
    )
    max_resume_readers: int = Field(
        default=256,
        ge=1,
        description="Replies read from their logs at once on one gateway process (resumes, "
        "and requests attached by their X-Request-Id); each holds a connection of a pool "
        "of its own.",
    )
    relay_queue_chunks: int = Field(
        default=1024,
        ge=1,
        description="Chunks buffered for one client; a client that falls this far behind "
        "is cut off with a slow_consumer error (it may resume from the log).",
    )
    sse_keepalive_s: float = Field(
        default=10.0,
        ge=0,
        description="A streamed request still waiting for its first token after this long "
        "gets its 200 and an SSE comment (': keep-alive'), then one every this long until "
        "the token comes, so no idle timeout cuts it; an error after that arrives as an SSE "
        "error event (0: never; the status waits for the first token).",
    )
    # Characters and sessions.
    session_affinity: bool = Field(
        default=True,
        description="Send a session's next turn to the replica that served its last one "
        "(its prefix cache holds the conversation) when that replica has room.",
    )
    affinity_wait_ms: int = Field(
        default=500, ge=0, description="How long other replicas leave such a turn alone."
    )
    session_ttl_s: int = Field(
        default=30 * 86_400,
        ge=60,
        description="A session idle this long is deleted (and stops counting against its "
        "tenant's quota).",
    )
    max_session_messages: int = Field(
        default=2_000,
        ge=2,
        description="Messages a session keeps (the oldest go first; prompts are cut to "
        "the context window anyway).",
    )
    default_system_prompt: str = Field(
        default="", description="System prompt for characters whose card has none."
    )
    memory_share: float = Field(
        default=0.75,
        ge=0,
        le=1,
        description="Summarise a session's oldest turns (a batch-class job) once its prompt "
        "passes this share of the context window; 0: never (older turns are only cut).",
    )
    memory_keep_messages: int = Field(
        default=8, ge=2, description="Latest messages a summary never takes in."
    )
    memory_max_tokens: int = Field(default=256, ge=16, description="Longest summary.")
    memory_prompt: str = Field(
        default="Summarize the story so far between {{char}} and {{user}} in one paragraph, "
        "keeping names, facts, promises, decisions and open threads. If a previous summary "
        "is given, extend it with the new events.",
        description="The instruction a summary job is given ({{char}}, {{user}} expand).",
    )
    prompt_layout: Literal["stable", "frontend"] = Field(
        default="stable",
        description="Where lorebook entries a key triggered go: stable = after the history, "
        "so the persona and history stay cached from turn to turn; frontend = inside the "
        "persona, as SillyTavern places them (cluster/characters/persona.py).",
    )

    # Limits (checked before anything is queued).
    max_body_bytes: int = Field(
        default=8 * 1024 * 1024, ge=1024, description="Largest request body (413 above)."
    )
    max_messages: int = Field(default=1024, ge=1, description="Most messages in one request.")
    tool_parser: Literal["hermes"] | None = Field(
        default=None,
        description="The served model's tool-call format, for tool_choice auto (hermes: "
        "<tool_call>{...}</tool_call>, as Hermes and Qwen 2.5 write); unset: auto is a 400, "
        "required and named functions are served by structured outputs.",
    )
    max_choices: int = Field(
        default=8,
        ge=1,
        le=128,
        description="Most choices (n) one request may ask for; each choice is one job, "
        "charged and admitted as such.",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="How long a client may take to send a request's headers (the "
        "connection is closed after that).",
    )
    max_completion_tokens: int | None = Field(
        default=None, ge=1, description="Largest max_tokens a request may ask (None: the window)."
    )
    auth: AuthMode = Field(
        default="open",
        description="keys: every /v1 route needs an API key (an empty key table means 401, "
        "never open); open: no keys, every caller is the tenant 'default', allowed only on "
        "a loopback bind.",
    )
    tenant_limits: Limits = Field(
        default_factory=Limits,
        description="Every tenant's limits (JSON; a tenant's own, set with `charserve keys "
        "limits`, override the fields they set): rates, fair-share weight, caps on queued "
        "and running jobs, streams and stored objects, allowed classes, budget floors.",
    )
    auth_cache_s: float = Field(
        default=2.0, ge=0, description="How long a gateway caches key lookups and limits."
    )
    reply_log_ttl_s: int = Field(
        default=REPLY_LOG_TTL_S,
        ge=1,
        # CHARSERVE_LOG_TTL_S is its name before 0.2 (still read).
        validation_alias=AliasChoices("CHARSERVE_REPLY_LOG_TTL_S", "CHARSERVE_LOG_TTL_S"),
        description="How long a reply can be resumed (its log lives).",
    )
    # The Batch API (gateway.batches).
    file_ttl_s: int = Field(
        default=30 * 86_400,
        ge=60,
        description="How long an uploaded file, a batch's output and error files, and a "
        "finished batch are kept.",
    )
    batch_lease_ms: int = Field(
        default=15_000,
        ge=100,
        description="A running batch line's lease; a gateway that dies loses its lines "
        "this long after its last renewal, and another gateway takes them over.",
    )
    batch_max_in_flight: int = Field(
        default=64, ge=1, description="Lines of one batch in the queue at once, all gateways."
    )
    batch_max_in_flight_per_gateway: int = Field(
        default=128, ge=1, description="Lines one gateway process runs at once, all batches."
    )
    batch_poll_ms: int = Field(
        default=1_000, ge=10, description="How often batch runners look for work."
    )
    batch_max_file_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1024,
        description="Largest uploaded file (the gateway's body bound applies too).",
    )
    batch_max_lines: int = Field(default=50_000, ge=1, description="Most requests in one batch.")
    batch_max_attempts: int = Field(
        default=3, ge=1, description="Runs of a line that fail unexpectedly before it fails."
    )
    batch_retry_max_s: float = Field(
        default=30.0, gt=0, description="Longest wait before retrying a refused batch line."
    )

    log_format: Literal["auto", "json", "console"] = Field(
        default="auto", description="auto: pretty on a TTY, JSON otherwise."
    )
    log_level: str = Field(default="info", description="Level of the gateway's logs.")
    tracing: TracingMode = Field(
        default="off",
        description="OpenTelemetry traces of requests: otlp (configured by the OTEL_* "
        "variables), console (stdout, to debug) or off (workers read the same variable).",
    )
