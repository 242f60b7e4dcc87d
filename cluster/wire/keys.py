"""Every Redis key and channel name charserve uses, in one place.

All keys share one namespace prefix so several deployments can share a Redis, and so an
operator can find (and ``SCAN``) everything charserve stores. The namespace is a hash tag
(``{charserve}:queue``): on Redis Cluster every key of a deployment lives in one slot, so
the multi-key Lua scripts (the queue's, the batch store's) never fail with CROSSSLOT. A
deployment is then one shard's work; several namespaces spread over shards. Nothing
outside this module spells a key (a test checks). Keys that hold one tenant's objects
carry the tenant, so another tenant's id is simply not found.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keys:
    """Key and channel names under one namespace."""

    namespace: str = "charserve"

    def _key(self, *parts: str) -> str:
        return ":".join((f"{{{self.namespace}}}", *parts))

    # -- the queue (cluster.wire.queue) ------------------------------------------------

    @property
    def queue(self) -> str:
        """Sorted set of queued job ids, score = deadline (EDF) or arrival (FIFO), in ms."""
        return self._key("queue")

    @property
    def jobs(self) -> str:
        """Hash: job id -> encoded Job body, for queued and claimed jobs."""
        return self._key("jobs")

    @property
    def leases(self) -> str:
        """Sorted set of claimed job ids, score = lease expiry (Redis time, ms)."""
        return self._key("leases")

    @property
    def owners(self) -> str:
        """Hash: claimed job id -> worker id holding its lease."""
        return self._key("owners")

    @property
    def batch_jobs(self) -> str:
        """Set of waiting or claimed job ids in the batch class (they yield headroom)."""
        return self._key("batch")

    @property
    def dead(self) -> str:
        """List of dead-lettered jobs (capped): encoded Job, newest first."""
        return self._key("dead")

    @property
    def wake(self) -> str:
        """List workers block on (BLPOP): one token per enqueue wakes one idle worker."""
        return self._key("wake")

    @property
    def prefer(self) -> str:
        """Hash: queued job id -> ``worker|until_ms``, the worker it should wait for."""
        return self._key("prefer")

    def wake_for(self, worker_id: str) -> str:
        """A wake list for one worker: enqueues of jobs that prefer it."""
        return self._key("wake", worker_id)

    def wake_for_adapter(self, adapter: str) -> str:
        """A wake list for the workers serving one LoRA adapter: enqueues of its jobs."""
        return self._key("wake-lora", adapter)

    @property
    def wake_for_adapter_prefix(self) -> str:
        """:meth:`wake_for_adapter` without its adapter (the requeue script completes it)."""
        return self._key("wake-lora", "")

    @property
    def job_info(self) -> str:
        """Hash: job id -> what the queue needs of it without decoding its body
        (``tenant|class|weight|bytes|flags|max_running|gateway|cost|adapter``)."""
        return self._key("jobinfo")

    def tenant_queue(self, priority_class: str, tenant: str) -> str:
        """Sorted set: one tenant's waiting job ids in one class (same scores as queue)."""
        return self._key("tq", priority_class, tenant)

    @property
    def tenant_queue_prefix(self) -> str:
        """:meth:`tenant_queue` without its class and tenant (the claim script completes
        it for the tenants it visits)."""
        return self._key("tq", "")

    def backlogged(self, priority_class: str) -> str:
        """Sorted set: tenants with waiting jobs in one class, score = virtual time."""
        return self._key("backlogged", priority_class)

    def virtual_time(self, priority_class: str) -> str:
        """Hash: tenant -> tokens served in one class over its weight (fair share)."""
        return self._key("vtime", priority_class)

    @property
    def tenant_waiting(self) -> str:
        """Hash: tenant -> jobs it has waiting in the queue."""
        return self._key("tenant-waiting")

    @property
    def tenant_bytes(self) -> str:
        """Hash: tenant -> bytes of the job bodies it has waiting in the queue."""
        return self._key("tenant-bytes")

    @property
    def tenant_running(self) -> str:
        """Hash: tenant -> jobs of it claimed by workers now."""
        return self._key("tenant-running")

    @property
    def cancelled(self) -> str:
        """Sorted set: cancelled job ids, score = when the record expires (Redis ms)."""
        return self._key("cancelled")

    @property
    def dead_bytes(self) -> str:
        """String: bytes held by the dead-letter list (it is capped by bytes)."""
        return self._key("dead-bytes")

    def idempotency(self, tenant: str, client_request_id: str) -> str:
        """String: ``job id|body digest`` of a tenant's request sent with this
        ``X-Request-Id`` (lives as long as the reply)."""
        return self._key("idem", tenant, client_request_id)

    # -- workers ---------------------------------------------------------------------

    @property
    def workers(self) -> str:
        """Sorted set of worker ids, score = last heartbeat (ms)."""
        return self._key("workers")

    def worker_stats(self, worker_id: str) -> str:
        """Latest encoded WorkerStats of one worker (expires with its heartbeat)."""
        return self._key("worker", worker_id)

    @property
    def worker_stats_prefix(self) -> str:
        """:meth:`worker_stats` without the worker id (for the capacity script)."""
        return self._key("worker", "")

    def worker_metrics(self, worker_id: str) -> str:
        """A worker's exported Prometheus text (expires unless refreshed)."""
        return self._key("metrics", worker_id)

    def control(self, worker_id: str) -> str:
        """Pub/sub channel carrying Cancel messages to one worker."""
        return self._key("control", worker_id)

    # -- gateways -------------------------------------------------------------------

    def gateway_alive(self, gateway_id: str) -> str:
        """String with a TTL a gateway process refreshes while it runs: a job whose
        gateway is gone has nobody to deliver to."""
        return self._key("gateway", gateway_id)

    @property
    def gateway_alive_prefix(self) -> str:
        """:meth:`gateway_alive` without the gateway id (for the claim script)."""
        return self._key("gateway", "")

    def gateway_metrics(self, group: str) -> str:
        """Hash: process -> Prometheus text of each gateway process serving one port
        (``host:port:supervisor pid``), plus the sums of those gone; expires unless
        refreshed."""
        return self._key("gateway-metrics", group)

    # -- replies (cluster.wire.replylog) ---------------------------------------------

    def inbox(self, gateway_id: str) -> str:
        """Pub/sub channel a gateway process receives every chunk of its requests on."""
        return self._key("inbox", gateway_id)

    def request_meta(self, request_id: str) -> str:
        """A request's owner and reply format (JSON), kept as long as its reply log."""
        return self._key("meta", request_id)

    def reply_log(self, request_id: str) -> str:
        """Capped stream of a request's chunks, for gap repair, resume and replay."""
        return self._key("log", request_id)

    # -- tenants (cluster.wire.tenants) ----------------------------------------------

    @property
    def api_keys(self) -> str:
        """Hash: SHA-256 of an API key -> its record (JSON: id, tenant, created, name)."""
        return self._key("apikeys")

    @property
    def api_key_ids(self) -> str:
        """Hash: key id -> SHA-256 of the key (for revocation by id)."""
        return self._key("apikey-ids")

    @property
    def tenant_limits(self) -> str:
        """Hash: tenant -> its own rate limits (JSON: rpm, tpm)."""
        return self._key("limits")

    def rate(self, tenant: str) -> str:
        """A tenant's rate-limit buckets (expire when idle)."""
        return self._key("rate", tenant)

    # -- characters and sessions (gateway.characters.store) ---------------------------

    def characters(self, tenant: str) -> str:
        """Hash: character id -> JSON record (id, created, card)."""
        return self._key("characters", tenant)

    def character_index(self, tenant: str) -> str:
        """Hash: character id -> its summary (JSON: id, created, name, spec), so a listing
        reads no card."""
        return self._key("character-index", tenant)

    def sessions(self, tenant: str) -> str:
        """Sorted set: the tenant's session ids, score = last activity (ms): what counts
        them against its quota, and what idle expiry prunes."""
        return self._key("sessions", tenant)

    def character_worker(self, tenant: str) -> str:
        """Hash: character id -> the worker that last served it (its prefix cache)."""
        return self._key("character-worker", tenant)

    def session(self, tenant: str, session_id: str) -> str:
        """Hash: one session's fields (character, user name, created, last worker)."""
        return self._key("session", tenant, session_id)

    def session_turns(self, tenant: str, session_id: str) -> str:
        """List: a session's messages as JSON, oldest first."""
        return self._key("session-turns", tenant, session_id)

    # -- files and batches (gateway.batches.store) ------------------------------------

    def file(self, tenant: str, file_id: str) -> str:
        """Hash: one file's object (bytes, created_at, filename, purpose)."""
        return self._key("file", tenant, file_id)

    def file_data(self, tenant: str, file_id: str) -> str:
        """String: one file's content."""
        return self._key("file-data", tenant, file_id)

    def files(self, tenant: str) -> str:
        """Sorted set: the tenant's file ids by creation (ms)."""
        return self._key("files", tenant)

    def file_sizes(self, tenant: str) -> str:
        """Hash: file id -> its size in bytes (what the tenant's byte quota sums)."""
        return self._key("file-sizes", tenant)

    def batches_open(self, tenant: str) -> str:
        """Set: the tenant's batch ids not yet in a final state (its batch quota)."""
        return self._key("batches-open", tenant)

    def batch_object(self, tenant: str, batch_id: str) -> str:
        """Hash: one batch's state."""
        return self._key("batch-obj", tenant, batch_id)

    def batch_list(self, tenant: str) -> str:
        """Sorted set: the tenant's batch ids by creation (ms)."""
        return self._key("batch-list", tenant)

    @property
    def batch_active(self) -> str:
        """Set of ``tenant/batch_id`` not yet in a final state (what runners poll)."""
        return self._key("batch-active")

    def batch_input(self, tenant: str, batch_id: str) -> str:
        """String: the batch's private copy of its input file."""
        return self._key("batch-input", tenant, batch_id)

    def batch_results(self, tenant: str, batch_id: str) -> str:
        """Hash: line index -> result (``o``/``e`` + JSON line)."""
        return self._key("batch-results", tenant, batch_id)

    def batch_leases(self, tenant: str, batch_id: str) -> str:
        """Sorted set: line index -> lease expiry (Redis time, ms)."""
        return self._key("batch-leases", tenant, batch_id)

    def batch_owners(self, tenant: str, batch_id: str) -> str:
        """Hash: line index -> id of the job running it."""
        return self._key("batch-owners", tenant, batch_id)

    def batch_lock(self, tenant: str, batch_id: str) -> str:
        """String: the process validating or finalizing the batch."""
        return self._key("batch-lock", tenant, batch_id)
