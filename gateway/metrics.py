"""The gateway's Prometheus metrics, on a private registry.

TTFT, inter-chunk latency, queue wait and end-to-end latency by priority class, admission
decisions by reason, request outcomes, active streams and relay lag. A
:class:`RequestTimer` per request keeps the hot path to one histogram observe. The
``/metrics`` page merges the workers' own texts in (see :mod:`cluster.runtime.prometheus`).

A gateway run as several processes on one port (``CHARSERVE_GATEWAY_WORKERS>1``) is one
target to Prometheus, yet each process counts on its own registry. There,
:class:`ProcessGroupMetrics` publishes this process's text to the group's Redis hash every
few seconds and before it answers a scrape, and the page adds up every process's text
(:func:`combine_processes`):

- counters and histograms are summed over every process the group has run, those gone
  included (their last text is kept, folded into one), so a sum never goes down when a
  process is replaced and ``rate()`` sees no false reset;
- gauges are summed over the live processes (``charserve_active_streams`` is then the
  gateway's), except :data:`SHARED_GAUGES`, snapshots of the cluster every process reads
  alike, which are the answering process's;
- the process collector's ``process_*`` families stay per process, labelled
  ``process="<pid>"`` (a sum of start times or fd limits means nothing, and a per-process
  CPU shows an uneven spread of connections).

With one process nothing is published and the page is exactly what that process counts.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable, Mapping

import redis.asyncio as aioredis
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.metrics_core import Metric

from cluster.runtime.prometheus import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    LATENCY_BUCKETS,
    MONOTONIC_TYPES,
    OTHER,
    PROCESS_LABEL,
    RELAY_BUCKETS,
    RETIRED,
    TokenHistogram,
    fold_texts,
    known,
    label_families,
    parse_text,
    process_members,
    publish_process_metrics,
    read_process_metrics,
    render_families,
    render_text,
    retire_processes,
    sum_families,
    without_created,
)
from cluster.wire.keys import Keys
from cluster.wire.protocol import Chunk
from cluster.wire.vocabulary import DropReason, ErrorCode, Outcome, PriorityClass

log = structlog.get_logger(__name__)

# How often each process of a group publishes its text (as workers do), and how long the
# group's hash outlives its last publication. The hash holds the sums of departed
# processes, so it must not lapse over a short Redis hiccup; once the whole group is gone
# it only has to go eventually.
EXPORT_INTERVAL_S = 5.0
GROUP_TTL_S = 60.0
# Families of the process collector: one set per process, labelled, never summed.
PER_PROCESS_PREFIX = "process_"
# Gauges of the cluster that every process reads alike (not of the process): the answering
# process's value, as with one process.
SHARED_GAUGES = frozenset({"charserve_queue_waiting", "charserve_workers"})


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


# -- several processes behind one port ------------------------------------------------


def process_group(port: int) -> str:
    """The group of this process: the gateway processes sharing its listening socket, i.e.
    the children of one uvicorn supervisor on this host (``host:port:supervisor pid``)."""
    return f"{socket.gethostname()}:{port}:{os.getppid()}"


def process_member(gateway_id: str) -> str:
    """This process's field in its group's hash: ``<pid>-<gateway id>`` (the id keeps a
    reused pid from overwriting a departed process's text)."""
    return f"{os.getpid()}-{gateway_id}"


def member_pid(member: str) -> str:
    """The pid in a member name (the ``process`` label)."""
    return member.partition("-")[0]


def member_alive(member: str) -> bool:
    """Whether the process a member names still runs. A group lives on one host, so its
    pid says; a pid another user owns is not a sibling's any more."""
    try:
        pid = int(member_pid(member))
        if pid <= 0:  # 0 and negatives address process groups, never one process
            return False
        os.kill(pid, 0)
    except (ValueError, OSError):
        return False
    return True


def _per_process(family: Metric) -> bool:
    return family.name.startswith(PER_PROCESS_PREFIX)


def _summed(family: Metric) -> bool:
    """Added up over the live processes."""
    return not _per_process(family) and family.name not in SHARED_GAUGES


def _retained(family: Metric) -> bool:
    """Kept from a process that is gone: what only grows (its gauges meant its own state)."""
    return family.type in MONOTONIC_TYPES and not _per_process(family)


def combine_processes(texts: Mapping[str, str], own: str, live: set[str]) -> list[Metric]:
    """The gateway families of a group's page, from every text of its hash (by member,
    plus :data:`~cluster.runtime.prometheus.RETIRED`): ``own`` is the answering process's
    member, ``live`` the members still running. See the module's docstring for what is
    summed, kept per process and retained. A garbled text is skipped, and logged."""
    parsed: dict[str, list[Metric]] = {}
    for member, text in texts.items():
        try:
            parsed[member] = parse_text(text)
        except Exception as exc:  # one garbled text must not break the whole page
            log.warning("unparsable gateway process metrics", member=member, error=str(exc))
    running = [m for m in parsed if m != RETIRED and (m == own or m in live)]
    sources = [
        [f for f in families if (_summed(f) if member in running else _retained(f))]
        for member, families in parsed.items()
    ]
    out = {f.name: f for f in sum_families(sources)}
    for family in parsed.get(own, []):
        if family.name in SHARED_GAUGES:
            out[family.name] = family
    per_process = {
        member_pid(m): [f for f in parsed[m] if _per_process(f)] for m in sorted(running)
    }
    for family in label_families((), per_process, PROCESS_LABEL):
        out[family.name] = family
    # The answering process's order (its registry's), so the page reads as one process's.
    order = {f.name: i for i, f in enumerate(parsed.get(own, []))}
    return sorted(out.values(), key=lambda f: order.get(f.name, len(order)))


def render_group_page(
    texts: Mapping[str, str], own: str, live: set[str], worker_texts: dict[str, str]
) -> bytes:
    """The whole ``/metrics`` page of a process group: :func:`combine_processes` plus the
    workers' texts."""
    return render_families(combine_processes(texts, own, live), worker_texts)


class ProcessGroupMetrics:
    """This process's part in its group's page: publishes its text to the group's hash
    every :data:`EXPORT_INTERVAL_S` (and before each page it renders), folds the texts of
    processes that are gone into one, and renders the group's page.

    Publications are serialized, so a text rendered earlier never overwrites a later one:
    each process's published counts only grow, and so does every sum a page shows
    (a sibling's counts reach the page within one interval)."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        redis: aioredis.Redis,
        key: str,
        member: str,
        interval_s: float = EXPORT_INTERVAL_S,
        alive: Callable[[str], bool] = member_alive,
    ) -> None:
        self._metrics = metrics
        self._redis = redis
        self.key = key
        self.member = member
        self._interval_s = interval_s
        self._alive = alive
        self._lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def start_for(
        cls,
        processes: int,
        port: int,
        metrics: GatewayMetrics,
        redis: aioredis.Redis,
        keys: Keys,
        gateway_id: str,
    ) -> ProcessGroupMetrics | None:
        """The started group export of a gateway run as ``processes`` processes on
        ``port``; None for one process (its own registry is the whole gateway)."""
        if processes <= 1:
            return None
        group = process_group(port)
        exporter = cls(metrics, redis, keys.gateway_metrics(group), process_member(gateway_id))
        await exporter.start()
        log.info("gateway metrics shared by the processes", group=group, member=exporter.member)
        return exporter

    def render(self) -> str:
        """This process's registry as exposition text (without ``_created``)."""
        return render_text(without_created(self._metrics.registry.collect()))

    async def publish(self) -> str:
        """Render this process's text (off the event loop) and store it; return it."""
        async with self._lock:
            text = await asyncio.to_thread(self.render)
            await publish_process_metrics(self._redis, self.key, self.member, text, GROUP_TTL_S)
        return text

    async def start(self) -> None:
        """Publish once (siblings count this process from now on), then every interval."""
        try:
            await self.publish()
        except Exception as exc:  # metrics never keep a gateway from starting
            log.warning("gateway metrics export failed", error=str(exc))
        self._task = asyncio.create_task(self._run(), name="gateway-metrics-export")

    async def close(self) -> None:
        """Stop exporting, after a last publication: what this process counted since the
        previous one stays in the group's sums once it is gone."""
        self._stop.set()
        if self._task is not None:
            await self._task
        try:
            await self.publish()
        except Exception as exc:
            log.warning("gateway metrics export failed", error=str(exc))

    async def page(self, worker_texts: dict[str, str]) -> bytes:
        """The group's ``/metrics`` page with the workers' texts. Raises
        :class:`redis.exceptions.RedisError` when Redis fails: a page of this process
        alone would look to Prometheus like counters going down."""
        own = await self.publish()
        texts = await read_process_metrics(self._redis, self.key)
        texts[self.member] = own  # the freshest, whatever the read raced with
        live = {m for m in texts if m != RETIRED and (m == self.member or self._alive(m))}
        await self._retire(texts, live)
        return await asyncio.to_thread(render_group_page, texts, self.member, live, worker_texts)

    async def _run(self) -> None:
        # Stopped by the event, not by cancelling: a Redis command cancelled midway can
        # leave its connection unusable.
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), self._interval_s)
            except TimeoutError:
                pass
            if self._stop.is_set():
                break
            try:
                await self.publish()
                members = await process_members(self._redis, self.key)
                if any(m != RETIRED and not self._alive(m) for m in members):
                    texts = await read_process_metrics(self._redis, self.key)
                    live = {m for m in texts if m != RETIRED and self._alive(m)}
                    await self._retire(texts, live)
            except Exception as exc:  # metrics never take a gateway down; retried
                log.warning("gateway metrics export failed", error=str(exc))

    async def _retire(self, texts: Mapping[str, str], live: set[str]) -> None:
        """Fold the texts of members that are gone into RETIRED: the hash stays as small
        as the live processes, however many the group has replaced."""
        departed = sorted(m for m in texts if m != RETIRED and m not in live)
        if not departed:
            return
        expected = texts.get(RETIRED, "")
        folded = await asyncio.to_thread(
            fold_texts, [expected, *(texts[m] for m in departed)], _retained
        )
        if await retire_processes(self._redis, self.key, expected, folded, departed):
            log.info("folded departed gateway processes' metrics", members=departed)
