"""Prometheus metrics: the gateway's and the workers' own, and vLLM's, all on one ``/metrics``.

Each side keeps its metrics on a private :class:`CollectorRegistry` (never the global one,
so tests can build many apps in one process):

- :class:`GatewayMetrics`: TTFT, inter-chunk latency, queue wait and end-to-end latency by
  priority class, admission decisions by reason, request outcomes, active streams and relay
  lag. A :class:`RequestTimer` per request keeps the hot path to one histogram observe.
- :class:`WorkerMetrics`: claims, jobs in flight, lease expiries, requeues, dead letters.

Workers take no HTTP traffic, so each one renders its registry plus vLLM's ``vllm:``
families (vLLM's ``AsyncLLM`` registers them in prometheus_client's global registry of the
replica process whenever stats logging is on, its default) as exposition text every few
seconds, and stores it in Redis under ``{ns}:metrics:{worker_id}`` with a TTL
(:func:`run_worker_exporter`). A gateway reads the texts of the live workers
(:func:`read_worker_metrics`) and :func:`render_all` merges them with its own: every
worker sample gets a ``replica`` label (its worker id) and families of the same name are
merged, so the page has one HELP/TYPE per family. ``_created`` series are dropped
everywhere: they double the series count and no dashboard uses them.

With several gateways, each one's page repeats the worker series (with its own
``instance`` label): queries over ``charserve_worker_*`` and ``vllm:*`` deduplicate with
``max by (replica, ...)`` before summing, as ``deploy/grafana/charserve.json`` does.
"""

from __future__ import annotations

import asyncio
import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import redis.asyncio as aioredis
import structlog
from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from cluster.wire.keys import Keys
from cluster.wire.protocol import Chunk

log = structlog.get_logger(__name__)

# The Prometheus text format generate_latest writes (0.26 advertises 1.0.0, which older
# Prometheus servers do not know; the bytes are the same).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REPLICA_LABEL = "replica"
VLLM_PREFIX = "vllm:"

PRIORITIES = ("interactive", "standard", "batch")
DROP_REASONS = ("budget", "queue_full", "no_workers", "expired", "rate_limited")
OUTCOMES = ("completed", "error", "expired", "cancelled", "timeout", "slow_consumer")
OTHER = "other"

# Seconds. TTFT and queue wait span interactive (ms) to batch (hours) and include the
# default budgets (2 s, 30 s, 24 h) as bounds, so SLO ratios need no interpolation.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
    5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 1.0, 2.0, 5.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0,
    120.0, 180.0, 300.0, 600.0, 1800.0, 3600.0, 14400.0, 86400.0,
)  # fmt: skip
RELAY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip


class TokenSeries:
    """One series of a :class:`TokenHistogram`: bucket counts and a sum."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count ``value`` in the first bucket whose bound is at least ``value``."""
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value


class TokenHistogram(Collector):
    """A Prometheus histogram for observations made once per token.

    prometheus_client's ``Histogram.observe`` takes a lock for the bucket and another for
    the sum and scans the buckets linearly (about 1.3 µs); a gateway relaying tens of
    thousands of tokens a second spent a tenth of its CPU there. This one bisects and
    increments a list slot. Observe from one thread only (the event loop); a scrape from
    another thread may see the sum one observation apart from the counts.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Iterable[str],
        buckets: tuple[float, ...],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._bounds = tuple(b for b in buckets if not math.isinf(b))
        self._series: dict[tuple[str, ...], TokenSeries] = {}
        registry.register(self)

    def labels(self, *values: str) -> TokenSeries:
        """The series of these label values (made on first use)."""
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name} takes labels {self._labelnames}, got {values}")
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = TokenSeries(self._bounds)
        return series

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            self._name, self._documentation, labels=list(self._labelnames)
        )
        for values, series in list(self._series.items()):
            counts, total = list(series.counts), series.sum
            cumulative, buckets = 0, []
            for bound, count in zip((*self._bounds, math.inf), counts, strict=True):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric(list(values), buckets, total)
        yield family


def _known(value: str | None, allowed: tuple[str, ...]) -> str:
    """``value`` if allowed, else ``other``: label values stay a small fixed set."""
    return value if value in allowed else OTHER


class GatewayMetrics:
    """The gateway's metrics, on :attr:`registry`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        by_class = ["priority"]
        self._ttft = Histogram(
            "charserve_ttft_seconds",
            "Arrival at the gateway to the first token written to the client.",
            by_class,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._itl = TokenHistogram(
            "charserve_itl_seconds",
            "Gap between successive content chunks written to a client (one chunk may "
            "carry several tokens when the worker coalesces).",
            by_class,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self._queue_wait = Histogram(
            "charserve_queue_wait_seconds",
            "Arrival to claim by a worker, as the worker measured it.",
            by_class,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._e2e = Histogram(
            "charserve_e2e_seconds",
            "Arrival to the final chunk of a completed request.",
            by_class,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self._relay_lag = TokenHistogram(
            "charserve_relay_lag_seconds",
            "A chunk's publication by its worker (or its receipt by this gateway's inbox) "
            "to its write to the client.",
            (),
            buckets=RELAY_BUCKETS,
            registry=r,
        )
        self._admission = Counter(
            "charserve_admission",
            "Admission decisions at the door, by reason for rejections.",
            ["priority", "decision", "reason"],
            registry=r,
        )
        self._requests = Counter(
            "charserve_requests",
            "Admitted requests by how they ended.",
            ["priority", "outcome"],
            registry=r,
        )
        self._active = Gauge(
            "charserve_active_streams",
            "Requests with a reply stream open on this gateway.",
            registry=r,
        )
        self._queued = Gauge(
            "charserve_queue_waiting",
            "Jobs waiting in the queue (gateway's last snapshot).",
            registry=r,
        )
        self._workers = Gauge(
            "charserve_workers", "Live workers (gateway's last snapshot).", registry=r
        )
        # Children resolved once: the hot path is a dict lookup and one observe. Creating
        # every series up front also makes them exist at 0, so rate() sees the first event.
        self.ttft = {p: self._ttft.labels(p) for p in (*PRIORITIES, OTHER)}
        self.itl = {p: self._itl.labels(p) for p in (*PRIORITIES, OTHER)}
        self.queue_wait = {p: self._queue_wait.labels(p) for p in (*PRIORITIES, OTHER)}
        self.e2e = {p: self._e2e.labels(p) for p in (*PRIORITIES, OTHER)}
        self.relay_lag = self._relay_lag.labels()
        for p in PRIORITIES:
            self._admission.labels(p, "admitted", "")
            for reason in DROP_REASONS:
                self._admission.labels(p, "rejected", reason)
            for outcome in OUTCOMES:
                self._requests.labels(p, outcome)

    def bind(
        self,
        *,
        active_streams: Callable[[], float] | None = None,
        queued: Callable[[], float] | None = None,
        workers: Callable[[], float] | None = None,
    ) -> None:
        """Read these gauges from the given callables at scrape time (no hot-path cost),
        e.g. ``active_streams=lambda: inbox.active``."""
        for gauge, fn in (
            (self._active, active_streams),
            (self._queued, queued),
            (self._workers, workers),
        ):
            if fn is not None:
                gauge.set_function(fn)

    def admitted(self, priority: str) -> None:
        """Count a request admitted at the door."""
        self._admission.labels(_known(priority, PRIORITIES), "admitted", "").inc()

    def rejected(self, priority: str | None, reason: str) -> None:
        """Count a request refused, by drop reason (``budget``, ``queue_full``, ...)."""
        p = _known(priority, PRIORITIES)
        self._admission.labels(p, "rejected", _known(reason, DROP_REASONS)).inc()

    def request(self, priority: str, arrival_ms: int) -> RequestTimer:
        """A timer for one admitted request that arrived at wall-clock ``arrival_ms``."""
        return RequestTimer(self, _known(priority, PRIORITIES), arrival_ms)

    def finished(self, priority: str, outcome: str, e2e_s: float | None) -> None:
        """Count a request's outcome; observe its end-to-end latency if it completed."""
        priority = _known(priority, PRIORITIES)
        self._requests.labels(priority, _known(outcome, OUTCOMES)).inc()
        if e2e_s is not None:
            self.e2e[priority].observe(e2e_s)


class RequestTimer:
    """Latency of one request: call :meth:`on_chunk` as each chunk is written to the
    client (the first gives TTFT and queue wait, later ones the inter-chunk gap) and
    :meth:`finish` once at the end (idempotent)."""

    __slots__ = ("_done", "_last", "_metrics", "_priority", "_start", "ttft_s")

    def __init__(self, metrics: GatewayMetrics, priority: str, arrival_ms: int) -> None:
        self._metrics = metrics
        self._priority = priority
        # Arrival on the monotonic clock, so every interval below is one subtraction.
        self._start = time.perf_counter() - max(0.0, time.time() - arrival_ms / 1000.0)
        self._last: float | None = None
        self._done = False
        self.ttft_s: float | None = None

    @property
    def elapsed_s(self) -> float:
        """Seconds since the request arrived."""
        return time.perf_counter() - self._start

    def on_chunk(self, chunk: Chunk) -> None:
        """Note ``chunk`` being written now; its ``sent_ms`` (the worker's wall-clock
        publication time) gives the relay lag."""
        now = time.perf_counter()
        m, p = self._metrics, self._priority
        if chunk.sent_ms > 0:
            m.relay_lag.observe(max(0.0, time.time() - chunk.sent_ms / 1000.0))
        if self._last is None:
            if chunk.error_code in (None, "expired"):
                m.queue_wait[p].observe(max(0.0, chunk.queue_ms / 1000.0))
            if chunk.error_code is None:
                self.ttft_s = now - self._start
                m.ttft[p].observe(self.ttft_s)
            self._last = now
        elif chunk.token_ids or chunk.text:
            m.itl[p].observe(now - self._last)
            self._last = now

    def finish(self, outcome: str) -> bool:
        """Count the request's outcome (see :data:`OUTCOMES`; :func:`chunk_outcome` maps
        a final chunk); a completed request also gives its end-to-end latency. False if
        it was already finished (later calls do nothing)."""
        if self._done:
            return False
        self._done = True
        self._metrics.finished(
            self._priority, outcome, self.elapsed_s if outcome == "completed" else None
        )
        return True


def chunk_outcome(chunk: Chunk) -> str:
    """The outcome a final chunk reports: completed, expired, cancelled or error."""
    if chunk.error_code is None:
        return "completed"
    return chunk.error_code if chunk.error_code in ("expired", "cancelled") else "error"


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
            "This worker's own leases found expired or taken at renewal.",
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
        self.claims = {p: self._claims.labels(p) for p in (*PRIORITIES, OTHER)}
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
        self.claims[_known(priority, PRIORITIES)].inc()

    def lease_expired(self, n: int = 1) -> None:
        """Count expired leases this worker reclaimed."""
        self._expiries.inc(n)

    def lease_lost(self, n: int = 1) -> None:
        """Count this worker's own leases lost at renewal."""
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


# -- rendering and merging ------------------------------------------------------------


class _Families:
    """A collector over fixed families, for ``generate_latest``."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def _without_created(families: Iterable[Metric]) -> Iterator[Metric]:
    """The families without their ``_created`` samples (and without empty families)."""
    for family in families:
        created = family.name + "_created"
        samples = [s for s in family.samples if s.name != created]
        if samples:
            if len(samples) != len(family.samples):
                family = _copy(family, samples)
            yield family


def _copy(family: Metric, samples: list[Any]) -> Metric:
    out = Metric(family.name, family.documentation, family.type, family.unit)
    out.samples = samples
    return out


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
    return generate_latest(_Families(_without_created(families))).decode()


_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
}


def _parse(text: str) -> list[Metric]:
    """Parse exposition text, folding back samples the parser split off their family.

    The text parser names a counter family without ``_total`` (as collectors do), but
    when a text declares ``# TYPE x counter`` and writes ``x_total`` samples, it yields an
    empty counter ``x`` plus an untyped ``x_total``; re-rendered as is, that would declare
    ``x_total`` twice. Such samples go back to their typed family. ``_created`` series
    (separate gauge families in the text format) and families left empty are dropped.
    """
    families: dict[str, Metric] = {}
    for family in text_string_to_metric_families(text):
        families.setdefault(family.name, family)
    for name, family in list(families.items()):
        if family.type not in ("unknown", "gauge"):
            continue
        base, _, suffix = name.rpartition("_")
        typed = families.get(base)
        if typed is None or typed.type not in _SUFFIXES:
            continue
        if suffix == "created":
            del families[name]
        elif family.type == "unknown" and f"_{suffix}" in _SUFFIXES[typed.type]:
            typed.samples.extend(family.samples)
            del families[name]
    return list(_without_created(families.values()))


def merge_families(
    own: Iterable[Metric], remote: dict[str, str], label: str = REPLICA_LABEL
) -> list[Metric]:
    """``own`` families merged with every remote text's, each remote sample labelled
    ``label=<its key in remote>``. A remote family whose type differs from the one
    already seen under its name (mixed versions) is skipped, and logged."""
    merged: dict[str, Metric] = {}
    for family in own:
        merged[family.name] = _copy(family, list(family.samples))
    for replica, text in sorted(remote.items()):
        try:
            families = _parse(text)
        except Exception as exc:  # one garbled text must not break the whole page
            log.warning("unparsable worker metrics", replica=replica, error=str(exc))
            continue
        for family in families:
            target = merged.setdefault(family.name, _copy(family, []))
            if target.type != family.type:
                log.warning(
                    "metric type conflict",
                    replica=replica,
                    metric=family.name,
                    type=family.type,
                    expected=target.type,
                )
                continue
            target.samples.extend(
                s._replace(labels={**s.labels, label: replica}) for s in family.samples
            )
    return list(merged.values())


def render_all(gateway_registry: CollectorRegistry, worker_texts: dict[str, str]) -> bytes:
    """One valid exposition of the gateway's registry plus every worker's text (keyed by
    worker id, which becomes the ``replica`` label)."""
    own = _without_created(gateway_registry.collect())
    return generate_latest(_Families(merge_families(own, worker_texts)))


# -- transport through Redis ----------------------------------------------------------


async def publish_worker_metrics(redis: aioredis.Redis, key: str, text: str, ttl_s: float) -> None:
    """Store a worker's exposition text for the gateways, expiring after ``ttl_s``."""
    await redis.set(key, text.encode(), px=max(1, int(ttl_s * 1000)))


async def run_worker_exporter(
    redis: aioredis.Redis,
    key: str,
    render: Callable[[], str],
    interval_s: float = 5.0,
    stop: asyncio.Event | None = None,
) -> None:
    """Render and publish every ``interval_s`` (TTL 3x that), until ``stop`` is set (or
    the task is cancelled). Rendering runs in a thread, off the event loop that streams
    tokens. Failures are logged and retried: metrics never take a worker down.

    Stop it with ``stop`` rather than by cancelling: a Redis command cancelled midway can
    leave its connection unusable for the client's own close."""
    stop = stop or asyncio.Event()
    while not stop.is_set():
        try:
            text = await asyncio.to_thread(render)
            await publish_worker_metrics(redis, key, text, 3 * interval_s)
        except Exception as exc:
            log.warning("metrics export failed", error=str(exc))
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except TimeoutError:
            pass


async def read_worker_metrics(
    redis: aioredis.Redis, keys: Keys, max_age_ms: int = 60_000
) -> dict[str, str]:
    """The exposition texts of the workers that sent a heartbeat in the last
    ``max_age_ms``, by worker id (one ZRANGEBYSCORE and one MGET; no SCAN)."""
    since = time.time_ns() // 1_000_000 - max_age_ms
    raw_ids = await redis.zrangebyscore(keys.workers, since, "+inf")
    ids = [i.decode() if isinstance(i, bytes) else str(i) for i in raw_ids]
    if not ids:
        return {}
    texts = await redis.mget([keys.worker_metrics(i) for i in ids])
    return {
        i: t.decode() if isinstance(t, bytes) else str(t)
        for i, t in zip(ids, texts, strict=True)
        if t is not None
    }
