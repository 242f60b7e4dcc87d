"""Metrics: observations, the merged exposition of gateway + workers, transport through a
real Redis, and the Grafana dashboard's metric names."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.runtime.prometheus import (
    ITL_BUCKETS,
    TokenHistogram,
    publish_worker_metrics,
    read_worker_metrics,
    render_all,
    run_worker_exporter,
)
from cluster.wire.keys import Keys
from cluster.wire.vocabulary import Outcome
from gateway.metrics import GatewayMetrics
from tests.fakes import make_chunk
from workers.loop.metrics import WorkerMetrics, render_worker_metrics

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "charserve.json"
_SUFFIXES = {
    "counter": ("",),
    "gauge": ("",),
    "untyped": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


def assert_valid_exposition(text: str) -> None:
    """Strict checks the Prometheus server makes: one HELP/TYPE per family, every sample
    under its own family's TYPE, and no series twice."""
    typed: set[str] = set()
    series: set[str] = set()
    family, kind = "", ""
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ")
            assert family not in typed, f"{family} declared twice"
            typed.add(family)
            continue
        name = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line)
        assert name is not None, line
        assert name.group() in {family + s for s in _SUFFIXES[kind]}, (line, family, kind)
        key = line.rsplit(" ", 1)[0]
        assert key not in series, f"duplicate series {key}"
        series.add(key)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition, by name and label set."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, frozenset(labels.items()))]


def fake_vllm(registry: CollectorRegistry, running: float, generated: float) -> None:
    """vLLM-shaped families (colons, a histogram whose name ends in _total)."""
    labels = ["model_name", "engine"]
    Gauge("vllm:num_requests_running", "Running.", labels, registry=registry).labels("m", "0").set(
        running
    )
    Counter("vllm:generation_tokens", "Generated.", labels, registry=registry).labels("m", "0").inc(
        generated
    )
    Histogram(
        "vllm:iteration_tokens_total", "Tokens/step.", labels, buckets=(1, 8), registry=registry
    ).labels("m", "0").observe(2)
    Counter("other_process_metric", "Not vLLM's.", registry=registry).inc()


def test_request_timer_observes_each_histogram_once() -> None:
    m = GatewayMetrics()
    timer = m.request("interactive", time.time_ns() // 1_000_000 - 200)
    timer.on_chunk(make_chunk(1, queue_ms=40.0))
    timer.on_chunk(make_chunk(2, sent_ms=time.time() * 1000 - 10))
    timer.on_chunk(make_chunk(3, text="", finish_reason="stop"))  # empty final: no ITL
    timer.finish(Outcome.of_error(make_chunk(3, text="", finish_reason="stop").error_code))
    timer.finish("error")  # idempotent
    out = render_all(m.registry, {}).decode()
    assert_valid_exposition(out)
    p = {"priority": "interactive"}
    assert value(out, "charserve_ttft_seconds_count", **p) == 1
    assert 0.2 <= value(out, "charserve_ttft_seconds_sum", **p) < 5
    assert value(out, "charserve_queue_wait_seconds_sum", **p) == pytest.approx(0.04)
    assert value(out, "charserve_itl_seconds_count", **p) == 1
    assert value(out, "charserve_e2e_seconds_count", **p) == 1
    assert value(out, "charserve_relay_lag_seconds_count") == 1
    assert value(out, "charserve_relay_lag_seconds_sum") >= 0.01
    assert value(out, "charserve_requests_total", outcome="completed", **p) == 1
    assert value(out, "charserve_requests_total", outcome="error", **p) == 0
    assert "_created" not in out


def test_expired_first_chunk_counts_queue_wait_but_no_ttft() -> None:
    m = GatewayMetrics()
    timer = m.request("batch", time.time_ns() // 1_000_000)
    expired = make_chunk(1, text="", finish_reason="error", error_code="expired", queue_ms=900.0)
    timer.on_chunk(expired)
    timer.finish(Outcome.of_error(expired.error_code))
    out = render_all(m.registry, {}).decode()
    p = {"priority": "batch"}
    assert value(out, "charserve_ttft_seconds_count", **p) == 0
    assert value(out, "charserve_queue_wait_seconds_sum", **p) == pytest.approx(0.9)
    assert value(out, "charserve_e2e_seconds_count", **p) == 0
    assert value(out, "charserve_requests_total", outcome="expired", **p) == 1


def test_admissions_and_bound_gauges() -> None:
    m = GatewayMetrics()
    streams = [1, 2, 3]
    m.bind(active_streams=lambda: len(streams), queued=lambda: 7, workers=lambda: 2)
    m.admitted("standard")
    m.rejected("interactive", "budget")
    m.rejected(None, "made_up")  # unknown values never create new label values
    out = render_all(m.registry, {}).decode()
    assert_valid_exposition(out)
    adm = "charserve_admission_total"
    assert value(out, adm, priority="standard", decision="admitted", reason="") == 1
    assert value(out, adm, priority="interactive", decision="rejected", reason="budget") == 1
    assert value(out, adm, priority="batch", decision="rejected", reason="queue_full") == 0
    assert value(out, adm, priority="other", decision="rejected", reason="other") == 1
    assert value(out, "charserve_active_streams") == 3
    assert value(out, "charserve_queue_waiting") == 7
    assert value(out, "charserve_workers") == 2


def test_two_replicas_merge_into_one_valid_exposition() -> None:
    texts = {}
    for replica, (running, generated) in {"w-a": (2, 10), "w-b": (5, 30)}.items():
        worker = WorkerMetrics()
        jobs = list(range(running))
        worker.bind(inflight=jobs.__len__, slots=lambda: 32)
        worker.claimed("interactive")
        worker.recovered("requeued")
        worker.recovered("requeued", handback=True)
        worker.recovered("dead_lettered")
        worker.poisoned()
        worker.lease_expired(2)
        worker.lease_lost()
        vllm = CollectorRegistry()
        fake_vllm(vllm, running, generated)
        texts[replica] = render_worker_metrics(worker, include_vllm=True, vllm_source=vllm)
    assert "other_process_metric" not in texts["w-a"]
    gateway = GatewayMetrics()
    gateway.admitted("interactive")
    out = render_all(gateway.registry, texts).decode()
    assert_valid_exposition(out)
    assert out.count("# TYPE vllm:generation_tokens_total counter") == 1
    vl = {"model_name": "m", "engine": "0"}
    for replica, running, generated in (("w-a", 2, 10), ("w-b", 5, 30)):
        r = {"replica": replica}
        assert value(out, "vllm:num_requests_running", **vl, **r) == running
        assert value(out, "vllm:generation_tokens_total", **vl, **r) == generated
        assert value(out, "vllm:iteration_tokens_total_bucket", le="8.0", **vl, **r) == 1
        assert value(out, "charserve_worker_inflight", **r) == running
        assert value(out, "charserve_worker_slots", **r) == 32
        assert value(out, "charserve_worker_claims_total", priority="interactive", **r) == 1
        assert value(out, "charserve_worker_requeues_total", reason="handback", **r) == 1
        assert value(out, "charserve_worker_requeues_total", reason="lease_expired", **r) == 1
        assert value(out, "charserve_worker_dead_letters_total", reason="attempts", **r) == 1
        assert value(out, "charserve_worker_dead_letters_total", reason="poison", **r) == 1
        assert value(out, "charserve_worker_lease_expiries_total", **r) == 2
        assert value(out, "charserve_worker_leases_lost_total", **r) == 1
    # The gateway's own samples carry no replica label.
    adm = {"priority": "interactive", "decision": "admitted", "reason": ""}
    assert value(out, "charserve_admission_total", **adm) == 1


def test_merge_repairs_parser_quirks_and_skips_bad_replicas() -> None:
    quirky = (
        "# HELP x Split by the parser.\n# TYPE x counter\n"
        'x_total{a="1"} 3\nx_created{a="1"} 1.7e9\n'
        "# TYPE y_total counter\ny_total 4\n# TYPE y_created gauge\ny_created 1.7e9\n"
        "# TYPE h histogram\n"
        'h_bucket{le="1.0"} 1\nh_bucket{le="+Inf"} 2\nh_sum 3\nh_count 2\nh_created 5\n'
        "# TYPE g gauge\ng 1\n"
    )
    conflicting = "# TYPE g counter\ng_total 9\n"
    out = render_all(
        CollectorRegistry(), {"a": quirky, "b": conflicting, "c": "not {{ metrics"}
    ).decode()
    assert_valid_exposition(out)
    assert value(out, "x_total", a="1", replica="a") == 3
    assert value(out, "y_total", replica="a") == 4
    assert value(out, "h_bucket", le="+Inf", replica="a") == 2
    assert value(out, "g", replica="a") == 1
    assert "_created" not in out
    assert 'replica="b"' not in out and 'replica="c"' not in out


async def test_worker_texts_travel_through_redis(redis: aioredis.Redis, keys: Keys) -> None:
    now = time.time_ns() // 1_000_000
    await redis.zadd(keys.workers, {"live": now, "silent": now, "gone": now - 600_000})
    await publish_worker_metrics(redis, keys.worker_metrics("live"), "a 1\n", ttl_s=5)
    await publish_worker_metrics(redis, keys.worker_metrics("gone"), "b 1\n", ttl_s=5)
    assert 0 < await redis.pttl(keys.worker_metrics("live")) <= 5000
    assert await read_worker_metrics(redis, keys) == {"live": "a 1\n"}

    worker = WorkerMetrics()
    worker.claimed("batch")
    task = asyncio.create_task(
        run_worker_exporter(
            redis, keys.worker_metrics("silent"), lambda: render_worker_metrics(worker), 0.05
        )
    )
    try:
        for _ in range(100):
            if await redis.exists(keys.worker_metrics("silent")):
                break
            await asyncio.sleep(0.02)
        texts = await read_worker_metrics(redis, keys)
        assert 0 < await redis.pttl(keys.worker_metrics("silent")) <= 150
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    out = render_all(CollectorRegistry(), texts).decode()
    assert value(out, "charserve_worker_claims_total", priority="batch", replica="silent") == 1


def _our_names() -> set[str]:
    """Every ``charserve_`` sample name."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    names = set()
    for registry in (GatewayMetrics().registry, WorkerMetrics().registry):
        for family in registry.collect():
            if family.name.startswith("charserve_"):
                names |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return names


def _vllm_names() -> set[str]:
    """Metric family names in the installed vLLM's source."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    names: set[str] = set()
    for path in Path(spec.origin).parent.rglob("*.py"):
        names |= set(re.findall(r"\"(vllm:[a-zA-Z0-9_:]+)\"", path.read_text(errors="replace")))
    return names


def test_dashboard_uses_only_metrics_that_exist() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    ours, vllm = _our_names(), _vllm_names()
    used: set[str] = set()
    for panel in panels:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            for name in re.findall(r"(?<![\w:])(charserve_\w+|vllm:[\w:]+)", target["expr"]):
                used.add(name)
                if name.startswith("vllm:"):
                    base = re.sub(r"_(total|bucket|sum|count)$", "", name)
                    assert name in vllm or base in vllm, (panel["title"], name)
                else:
                    assert name in ours, (panel["title"], name)
    assert ours - used <= {
        "charserve_ttft_seconds_sum", "charserve_ttft_seconds_count",
        "charserve_itl_seconds_sum", "charserve_itl_seconds_count",
        "charserve_queue_wait_seconds_sum", "charserve_queue_wait_seconds_count",
        "charserve_e2e_seconds_sum", "charserve_e2e_seconds_count",
        "charserve_relay_lag_seconds_sum", "charserve_relay_lag_seconds_count",
    }  # fmt: skip
    for needed in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                   "prefix_cache_hits_total", "generation_tokens_total"):  # fmt: skip
        assert f"vllm:{needed}" in used


@pytest.mark.parametrize("labels", [(), ("priority",)])
def test_token_histogram_exposes_what_prometheus_clients_histogram_does(
    labels: tuple[str, ...],
) -> None:
    reference, ours = CollectorRegistry(), CollectorRegistry()
    expected = Histogram("x_seconds", "doc", labels, buckets=ITL_BUCKETS, registry=reference)
    fast = TokenHistogram("x_seconds", "doc", labels, ITL_BUCKETS, ours)
    values = ("standard",) if labels else ()
    # Below, on and between bounds, and past the last one.
    for v in (0.0, 0.001, 0.0011, 0.05, 0.07, 0.05, 3.0, 9.0):
        (expected.labels(*values) if labels else expected).observe(v)
        fast.labels(*values).observe(v)
    want = [
        line for line in generate_latest(reference).decode().splitlines() if "_created" not in line
    ]
    assert generate_latest(ours).decode().splitlines() == want
    with pytest.raises(ValueError):
        fast.labels("a", "b")
