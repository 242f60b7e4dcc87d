"""A worker's Prometheus metrics, on a private registry, and the exposition text it
exports through Redis (with vLLM's own ``vllm:`` families) for the gateways' ``/metrics``.

Claims, jobs in flight, lease expiries, requeues and dead letters. Unlabelled by worker:
the gateway adds ``replica`` to every worker sample, as it does to vLLM's.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.registry import Collector

from cluster.runtime.prometheus import OTHER, VLLM_PREFIX, Families, known, without_created
from cluster.wire.vocabulary import PriorityClass


class WorkerMetrics:
    """One worker's metrics, on :attr:`registry`. Unlabelled by worker: the gateway adds
    ``replica`` to every worker sample, as it does to vLLM's."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._claims = Counter(
            "charserve_worker_claims", "Jobs claimed from the queue.", ["priority"], registry=r
        )
        self._inflight = Gauge("charserve_worker_inflight", "Jobs running now.", registry=r)
        self._slots = Gauge("charserve_worker_slots", "Batch slots of the engine.", registry=r)
        self._expiries = Counter(
            "charserve_worker_lease_expiries",
            "Expired leases (of any worker) this worker reclaimed.",
            registry=r,
        )
        self._lost = Counter(
            "charserve_worker_leases_lost",
            "This worker's own leases found expired or taken: at renewal, publish or ack.",
            registry=r,
        )
        self._requeues = Counter(
            "charserve_worker_requeues",
            "Jobs put back on the queue: after a lease expiry, or handed back at shutdown.",
            ["reason"],
            registry=r,
        )
        self._dead = Counter(
            "charserve_worker_dead_letters",
            "Jobs dead-lettered: too many attempts, or an undecodable body.",
            ["reason"],
            registry=r,
        )
        self.claims = {p: self._claims.labels(p) for p in (*PriorityClass, OTHER)}
        for reason in ("lease_expired", "handback"):
            self._requeues.labels(reason)
        for reason in ("attempts", "poison"):
            self._dead.labels(reason)

    def bind(
        self,
        *,
        inflight: Callable[[], float] | None = None,
        slots: Callable[[], float] | None = None,
    ) -> None:
        """Read the gauges from callables at render time, e.g. ``lambda: len(running)``."""
        if inflight is not None:
            self._inflight.set_function(inflight)
        if slots is not None:
            self._slots.set_function(slots)

    def claimed(self, priority: str) -> None:
        """Count one claimed job."""
        self.claims[known(priority, PriorityClass)].inc()

    def lease_expired(self, n: int = 1) -> None:
        """Count expired leases this worker reclaimed."""
        self._expiries.inc(n)

    def lease_lost(self, n: int = 1) -> None:
        """Count this worker's own leases found lost (at renewal, publish or ack)."""
        self._lost.inc(n)

    def recovered(self, outcome: str, *, handback: bool = False) -> None:
        """Count what recovery did with a job (``workers.loop.recovery.Outcome``)."""
        if outcome == "requeued":
            self._requeues.labels("handback" if handback else "lease_expired").inc()
        elif outcome == "dead_lettered":
            self._dead.labels("attempts").inc()

    def poisoned(self) -> None:
        """Count a job dead-lettered because its body could not be decoded."""
        self._dead.labels("poison").inc()


def render_worker_metrics(
    worker_metrics: WorkerMetrics, include_vllm: bool = True, vllm_source: Collector = REGISTRY
) -> str:
    """A worker's exposition text: its own metrics, plus the ``vllm:`` families of
    ``vllm_source`` (the process's global registry, where vLLM registers them) when
    ``include_vllm``.

    vLLM's metrics are read from this process's registry, never through a
    ``PROMETHEUS_MULTIPROC_DIR``: that directory may be shared by every replica on a host.
    """
    families = list(worker_metrics.registry.collect())
    if include_vllm:
        families += [f for f in vllm_source.collect() if f.name.startswith(VLLM_PREFIX)]
    return generate_latest(Families(without_created(families))).decode()
