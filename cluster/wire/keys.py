"""Every Redis key and channel name charserve uses, in one place.

All keys share one namespace prefix so several deployments can share a Redis, and so an
operator can find (and ``SCAN``) everything charserve stores.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keys:
    """Key and channel names under one namespace."""

    namespace: str = "charserve"

    @property
    def queue(self) -> str:
        """Sorted set of queued job ids, score = deadline (EDF) or arrival (FIFO), in ms."""
        return f"{self.namespace}:queue"

    @property
    def jobs(self) -> str:
        """Hash: job id -> encoded Job body, for queued and claimed jobs."""
        return f"{self.namespace}:jobs"

    @property
    def leases(self) -> str:
        """Sorted set of claimed job ids, score = lease expiry (Redis time, ms)."""
        return f"{self.namespace}:leases"

    @property
    def owners(self) -> str:
        """Hash: claimed job id -> worker id holding its lease."""
        return f"{self.namespace}:owners"

    @property
    def batch(self) -> str:
        """Set of waiting or claimed job ids in the batch class (they yield headroom)."""
        return f"{self.namespace}:batch"

    @property
    def dead(self) -> str:
        """List of dead-lettered jobs (capped): encoded Job, newest first."""
        return f"{self.namespace}:dead"

    @property
    def wake(self) -> str:
        """List workers block on (BLPOP): one token per enqueue wakes one idle worker."""
        return f"{self.namespace}:wake"

    @property
    def prefer(self) -> str:
        """Hash: queued job id -> ``worker|until_ms``, the worker it should wait for."""
        return f"{self.namespace}:prefer"

    def wake_for(self, worker_id: str) -> str:
        """A wake list for one worker: enqueues of jobs that prefer it."""
        return f"{self.namespace}:wake:{worker_id}"

    @property
    def workers(self) -> str:
        """Sorted set of worker ids, score = last heartbeat (ms)."""
        return f"{self.namespace}:workers"

    def worker_stats(self, worker_id: str) -> str:
        """Latest encoded WorkerStats of one worker (expires with its heartbeat)."""
        return f"{self.namespace}:worker:{worker_id}"

    def worker_metrics(self, worker_id: str) -> str:
        """A worker's exported Prometheus text (expires unless refreshed)."""
        return f"{self.namespace}:metrics:{worker_id}"

    def inbox(self, gateway_id: str) -> str:
        """Pub/sub channel a gateway process receives every chunk of its requests on."""
        return f"{self.namespace}:inbox:{gateway_id}"

    def control(self, worker_id: str) -> str:
        """Pub/sub channel carrying Cancel messages to one worker."""
        return f"{self.namespace}:control:{worker_id}"

    def meta(self, request_id: str) -> str:
        """A request's owner and reply format (JSON), kept as long as its log."""
        return f"{self.namespace}:meta:{request_id}"

    def log(self, request_id: str) -> str:
        """Capped stream of a request's chunks, for gap repair, resume and replay."""
        return f"{self.namespace}:log:{request_id}"

    @property
    def api_keys(self) -> str:
        """Hash: SHA-256 of an API key -> its record (JSON: id, tenant, created, name)."""
        return f"{self.namespace}:apikeys"

    @property
    def api_key_ids(self) -> str:
        """Hash: key id -> SHA-256 of the key (for revocation by id)."""
        return f"{self.namespace}:apikey-ids"

    @property
    def tenant_limits(self) -> str:
        """Hash: tenant -> its own rate limits (JSON: rpm, tpm)."""
        return f"{self.namespace}:limits"

    def rate(self, tenant: str) -> str:
        """A tenant's rate-limit buckets (expire when idle)."""
        return f"{self.namespace}:rate:{tenant}"
