"""The gateway's Prometheus metrics, on a private registry.

TTFT, inter-chunk latency, queue wait and end-to-end latency by priority class, admission
decisions by reason, request outcomes, active streams and relay lag. A
:class:`RequestTimer` per request keeps the hot path to one histogram observe. The
``/metrics`` page merges the workers' own texts in (see :mod:`cluster.runtime.prometheus`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from cluster.runtime.prometheus import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    LATENCY_BUCKETS,
    OTHER,
    RELAY_BUCKETS,
    TokenHistogram,
    known,
)
from cluster.wire.protocol import Chunk
from cluster.wire.vocabulary import DropReason, ErrorCode, Outcome, PriorityClass


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
        self.ttft = {p: self._ttft.labels(p) for p in (*PriorityClass, OTHER)}
        self.itl = {p: self._itl.labels(p) for p in (*PriorityClass, OTHER)}
        self.queue_wait = {p: self._queue_wait.labels(p) for p in (*PriorityClass, OTHER)}
        self.e2e = {p: self._e2e.labels(p) for p in (*PriorityClass, OTHER)}
        self.relay_lag = self._relay_lag.labels()
        for p in PriorityClass:
            self._admission.labels(p, "admitted", "")
            for reason in DropReason:
                self._admission.labels(p, "rejected", reason)
            for outcome in Outcome:
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
        self._admission.labels(known(priority, PriorityClass), "admitted", "").inc()

    def rejected(self, priority: str | None, reason: str) -> None:
        """Count a request refused, by drop reason (``budget``, ``queue_full``, ...)."""
        p = known(priority, PriorityClass)
        self._admission.labels(p, "rejected", known(reason, DropReason)).inc()

    def request(self, priority: str, arrival_ms: int) -> RequestTimer:
        """A timer for one admitted request that arrived at wall-clock ``arrival_ms``."""
        return RequestTimer(self, known(priority, PriorityClass), arrival_ms)

    def finished(self, priority: str, outcome: str, e2e_s: float | None) -> None:
        """Count a request's outcome; observe its end-to-end latency if it completed."""
        priority = known(priority, PriorityClass)
        self._requests.labels(priority, known(outcome, Outcome)).inc()
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
            if chunk.error_code in (None, ErrorCode.EXPIRED):
                m.queue_wait[p].observe(max(0.0, chunk.queue_ms / 1000.0))
            if chunk.error_code is None:
                self.ttft_s = now - self._start
                m.ttft[p].observe(self.ttft_s)
            self._last = now
        elif chunk.token_ids or chunk.text:
            m.itl[p].observe(now - self._last)
            self._last = now

    def finish(self, outcome: str) -> bool:
        """Count the request's :class:`Outcome` (``Outcome.of_error`` maps a final
        chunk); a completed request also gives its end-to-end latency. False if it was
        already finished (later calls do nothing)."""
        if self._done:
            return False
        self._done = True
        self._metrics.finished(
            self._priority, outcome, self.elapsed_s if outcome == Outcome.COMPLETED else None
        )
        return True
