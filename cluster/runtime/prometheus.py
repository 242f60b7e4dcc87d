"""Prometheus helpers shared by gateways and workers: per-token histograms, label bounds,
and the transport of worker metrics through Redis onto one ``/metrics`` page.

Each side keeps its metrics on a private :class:`CollectorRegistry` (never the global one,
so tests can build many apps in one process): :mod:`gateway.metrics` and
:mod:`workers.loop.metrics`.

Workers take no HTTP traffic, so each one renders its registry plus vLLM's ``vllm:``
families (vLLM's ``AsyncLLM`` registers them in prometheus_client's global registry of the
replica process whenever stats logging is on, its default) as exposition text every few
seconds, and stores it in Redis under the worker's metrics key with a TTL
(:func:`run_worker_exporter`). A gateway reads the texts of the live workers
(:func:`read_worker_metrics`) and :func:`render_all` merges them with its own: every
worker sample gets a ``replica`` label (its worker id) and families of the same name are
merged, so the page has one HELP/TYPE per family. ``_created`` series are dropped
everywhere: they double the series count and no dashboard uses them.

With several gateways, each one's page repeats the worker series (with its own
``instance`` label): queries over ``charserve_worker_*`` and ``vllm:*`` deduplicate with
``max by (replica, ...)`` before summing, as ``deploy/grafana/charserve.json`` does.

Several processes behind one port (a gateway run with ``CHARSERVE_GATEWAY_WORKERS>1``)
form a *process group*: each one stores its own text in one Redis hash of the group
(:func:`publish_process_metrics`), any of them reads the hash back
(:func:`read_process_metrics`) and adds the texts up (:func:`sum_families`) into the
page, so a scrape sees the whole gateway whichever process answers it. The texts of
processes that are gone are folded into one ``retired`` field
(:func:`retire_processes`); :mod:`gateway.metrics` decides what is summed, kept per
process or retained.
"""

from __future__ import annotations

import asyncio
import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from enum import StrEnum
from typing import Any

import redis.asyncio as aioredis
import structlog
from prometheus_client import (
    CollectorRegistry,
    generate_latest,
)
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from cluster.runtime.clock import now_ms
from cluster.wire.keys import Keys

log = structlog.get_logger(__name__)

# The Prometheus text format generate_latest writes (0.26 advertises 1.0.0, which older
# Prometheus servers do not know; the bytes are the same).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REPLICA_LABEL = "replica"
PROCESS_LABEL = "process"
VLLM_PREFIX = "vllm:"
# Types whose every sample only grows while its process runs: the last values of a process
# that is gone stay in a sum (folded into RETIRED), so the sum never goes down.
MONOTONIC_TYPES = frozenset({"counter", "histogram", "summary"})
# The field of a process group's hash holding the sums of the processes that are gone.
RETIRED = "retired"

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


def known(value: str | None, allowed: type[StrEnum]) -> str:
    """``value`` if it is one of ``allowed``, else ``other``: label values stay a small
    fixed set whatever a message from another build carries."""
    return str(value) if value in allowed._value2member_map_ else OTHER


class Families:
    """A collector over fixed families, for ``generate_latest``."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


# -- rendering and merging ------------------------------------------------------------


def without_created(families: Iterable[Metric]) -> Iterator[Metric]:
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
    return list(without_created(families.values()))


def parse_text(text: str) -> list[Metric]:
    """The families of one exposition text, repaired as the merge needs them (the
    parser's split counters folded back, ``_created`` dropped). Raises on garbled text."""
    return _parse(text)


def merge_families(
    own: Iterable[Metric], remote: dict[str, str], label: str = REPLICA_LABEL
) -> list[Metric]:
    """``own`` families merged with every remote text's, each remote sample labelled
    ``label=<its key in remote>``. A remote family whose type differs from the one
    already seen under its name (mixed versions) is skipped, and logged."""
    parsed: dict[str, list[Metric]] = {}
    for replica, text in sorted(remote.items()):
        try:
            parsed[replica] = _parse(text)
        except Exception as exc:  # one garbled text must not break the whole page
            log.warning("unparsable worker metrics", replica=replica, error=str(exc))
    return label_families(own, parsed, label)


def label_families(
    own: Iterable[Metric], remote: Mapping[str, Iterable[Metric]], label: str
) -> list[Metric]:
    """``own`` families merged with ``remote`` ones, each remote sample labelled
    ``label=<its key in remote>`` (one family per name, in the order first seen). A
    remote family whose type differs from the one already seen under its name is
    skipped, and logged."""
    merged: dict[str, Metric] = {}
    for family in own:
        merged[family.name] = _copy(family, list(family.samples))
    for value, families in remote.items():
        for family in families:
            target = merged.setdefault(family.name, _copy(family, []))
            if target.type != family.type:
                log.warning(
                    "metric type conflict",
                    replica=value,
                    metric=family.name,
                    type=family.type,
                    expected=target.type,
                )
                continue
            target.samples.extend(
                s._replace(labels={**s.labels, label: value}) for s in family.samples
            )
    return list(merged.values())


def sum_families(sources: Iterable[Iterable[Metric]]) -> list[Metric]:
    """The families of several processes added up: samples of the same name and labels
    summed (counters, histogram buckets, sums and counts, gauges alike), one family per
    name, in the order first seen. A family whose type differs from the one first seen
    under its name (mixed versions) is skipped, and logged."""
    merged: dict[str, Metric] = {}
    series: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], Any]] = {}
    for families in sources:
        for family in families:
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = _copy(family, [])
                series[family.name] = {}
            elif target.type != family.type:
                log.warning(
                    "metric type conflict",
                    metric=family.name,
                    type=family.type,
                    expected=target.type,
                )
                continue
            found = series[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                prior = found.get(key)
                if prior is None:
                    # A sum has no one timestamp or exemplar.
                    found[key] = sample._replace(timestamp=None, exemplar=None)
                else:
                    found[key] = prior._replace(value=prior.value + sample.value)
    for name, family in merged.items():
        family.samples = list(series[name].values())
    return list(merged.values())


def fold_texts(texts: Iterable[str], keep: Callable[[Metric], bool]) -> str:
    """One exposition text of the families ``keep`` accepts in ``texts``, added up (what
    :data:`RETIRED` holds). Garbled texts are skipped, and logged."""
    sources = []
    for text in texts:
        try:
            sources.append([f for f in _parse(text) if keep(f)])
        except Exception as exc:
            log.warning("unparsable process metrics", error=str(exc))
    return render_text(sum_families(sources))


def render_text(families: Iterable[Metric]) -> str:
    """``families`` as exposition text."""
    return generate_latest(Families(families)).decode()


def render_families(own: Iterable[Metric], worker_texts: dict[str, str]) -> bytes:
    """One valid exposition of ``own`` families plus every worker's text (keyed by worker
    id, which becomes the ``replica`` label)."""
    return generate_latest(Families(merge_families(own, worker_texts)))


def render_all(gateway_registry: CollectorRegistry, worker_texts: dict[str, str]) -> bytes:
    """One valid exposition of the gateway's registry plus every worker's text (keyed by
    worker id, which becomes the ``replica`` label)."""
    return render_families(without_created(gateway_registry.collect()), worker_texts)


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
    since = now_ms() - max_age_ms
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


# -- process groups: several processes behind one port --------------------------------

# Folds the texts of processes that are gone into RETIRED, if nobody did meanwhile: the
# RETIRED the caller summed from is still there, and so is every text it folded in. Two
# processes folding at once cannot both count the same text.
_RETIRE = """
local current = redis.call('HGET', KEYS[1], ARGV[1]) or ''
if current ~= ARGV[2] then return 0 end
for i = 4, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then return 0 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('HDEL', KEYS[1], unpack(ARGV, 4))
return 1
"""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def publish_process_metrics(
    redis: aioredis.Redis, key: str, member: str, text: str, ttl_s: float
) -> None:
    """Store one process's exposition text in its group's hash, which expires ``ttl_s``
    after the group's last publication."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(key, member, text.encode())
        pipe.pexpire(key, max(1, int(ttl_s * 1000)))
        await pipe.execute()


async def read_process_metrics(redis: aioredis.Redis, key: str) -> dict[str, str]:
    """Every text of a process group, by member (and :data:`RETIRED`), in one HGETALL."""
    raw = await redis.hgetall(key)
    return {_text(k): _text(v) for k, v in raw.items()}


async def process_members(redis: aioredis.Redis, key: str) -> list[str]:
    """The members of a process group with a text (and :data:`RETIRED`, if any)."""
    return [_text(k) for k in await redis.hkeys(key)]


async def retire_processes(
    redis: aioredis.Redis, key: str, expected: str, folded: str, members: Iterable[str]
) -> bool:
    """Replace ``members``' texts by ``folded``, the sum of the :data:`RETIRED` text read
    as ``expected`` ('' for none) and theirs; False (and nothing changed) if another
    process folded meanwhile."""
    names = list(members)
    if not names:
        return False
    done = await redis.register_script(_RETIRE)(
        keys=[key], args=[RETIRED, expected.encode(), folded.encode(), *names]
    )
    return bool(done)
