"""``/metrics`` of a gateway run as several processes on one port: one page that adds up
every process's counts, whichever process answers the scrape.

The first tests check the sums, what stays per process and what a departed process leaves
behind, on real registries and a real Redis. The last one runs ``charserve gateway`` with
``CHARSERVE_GATEWAY_WORKERS=3`` (uvicorn's supervisor and three processes on one socket)
against the session's Redis, with no worker: every chat request is refused at the door
(``no_workers``) and counted by the process that took it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from cluster.runtime.net import free_port, wait_ready
from cluster.runtime.prometheus import (
    PROCESS_LABEL,
    RETIRED,
    process_members,
    read_process_metrics,
    render_families,
)
from cluster.wire.keys import Keys
from gateway.metrics import (
    GatewayMetrics,
    ProcessGroupMetrics,
    combine_processes,
    member_alive,
    member_pid,
)
from tests.cluster.test_metrics import assert_valid_exposition, samples, value
from tests.polling import eventually

MODEL = "smollm2-135m-instruct"
ADMISSION = "charserve_admission_total"
NO_WORKERS = {"priority": "interactive", "decision": "rejected", "reason": "no_workers"}


def _counted(rejections: int, streams: int = 0, workers: int = 0) -> GatewayMetrics:
    m = GatewayMetrics()
    for _ in range(rejections):
        m.rejected("interactive", "no_workers")
    m.bind(active_streams=lambda: streams, queued=lambda: 7, workers=lambda: workers)
    return m


def _text(m: GatewayMetrics) -> str:
    return render_families(m.registry.collect(), {}).decode()


def _page(texts: dict[str, str], own: str, live: set[str]) -> str:
    return render_families(combine_processes(texts, own, live), {}).decode()


def _total(text: str, name: str = ADMISSION) -> float:
    return sum(v for (n, _), v in samples(text).items() if n == name)


# -- the sums ----------------------------------------------------------------------


def test_counters_histograms_and_own_gauges_add_up() -> None:
    a, b, c = _counted(3, streams=1, workers=2), _counted(4, streams=2), _counted(0, streams=5)
    a.finished("interactive", "completed", 0.5)
    b.finished("interactive", "completed", 2.5)
    texts = {"11-a": _text(a), "12-b": _text(b), "13-c": _text(c)}
    page = _page(texts, "11-a", {"11-a", "12-b", "13-c"})
    assert_valid_exposition(page)
    assert value(page, ADMISSION, **NO_WORKERS) == 7
    p = {"priority": "interactive"}
    assert value(page, "charserve_requests_total", outcome="completed", **p) == 2
    assert value(page, "charserve_e2e_seconds_count", **p) == 2
    assert value(page, "charserve_e2e_seconds_sum", **p) == 3.0
    assert value(page, "charserve_e2e_seconds_bucket", le="1.0", **p) == 1
    assert value(page, "charserve_e2e_seconds_bucket", le="+Inf", **p) == 2
    # Open streams are each process's own: the gateway's are their sum.
    assert value(page, "charserve_active_streams") == 8
    # Snapshots of the cluster are the answering process's, as with one process.
    assert value(page, "charserve_workers") == 2
    assert value(page, "charserve_queue_waiting") == 7
    # The process collector's families stay per process, labelled by pid.
    rss = {
        dict(labels)[PROCESS_LABEL]
        for (name, labels) in samples(page)
        if name == "process_resident_memory_bytes"
    }
    assert rss == {"11", "12", "13"}


def test_a_departed_process_keeps_its_counts_but_not_its_gauges() -> None:
    a, gone = _counted(2, streams=1), _counted(5, streams=4)
    texts = {"11-a": _text(a), "12-gone": _text(gone)}
    page = _page(texts, "11-a", {"11-a"})
    assert_valid_exposition(page)
    assert value(page, ADMISSION, **NO_WORKERS) == 7  # never goes down: no false reset
    assert value(page, "charserve_active_streams") == 1
    assert 'process="12"' not in page


def test_a_garbled_text_is_skipped() -> None:
    a = _counted(2)
    page = _page({"11-a": _text(a), "12-b": "not {{ metrics"}, "11-a", {"11-a", "12-b"})
    assert_valid_exposition(page)
    assert value(page, ADMISSION, **NO_WORKERS) == 2


def test_member_liveness_is_the_pid() -> None:
    assert member_alive(f"{os.getpid()}-abc")
    assert member_pid(f"{os.getpid()}-abc") == str(os.getpid())
    assert not member_alive("0-abc") and not member_alive("nonsense")
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, check=True)  # fmt: skip
    assert not member_alive(f"{int(done.stdout)}-gone")


# -- through Redis -----------------------------------------------------------------


async def test_processes_share_one_page_through_redis(redis: aioredis.Redis, keys: Keys) -> None:
    alive = {"1-a", "2-b", "3-c"}
    key = keys.gateway_metrics("host:8000:1")
    metrics = {"1-a": _counted(1), "2-b": _counted(2), "3-c": _counted(4)}
    group = {
        m: ProcessGroupMetrics(counts, redis, key, m, interval_s=0.05, alive=alive.__contains__)
        for m, counts in metrics.items()
    }
    for exporter in group.values():
        await exporter.start()
    try:
        for member, exporter in group.items():
            page = (await exporter.page({})).decode()
            assert_valid_exposition(page)
            assert value(page, ADMISSION, **NO_WORKERS) == 7, member
        assert 0 < await redis.pttl(key) <= 60_000

        # 3-c is gone: its counts are folded into one field, and every page keeps them.
        await group["3-c"].close()
        alive.discard("3-c")
        metrics["2-b"].rejected("interactive", "no_workers")
        page = (await group["2-b"].page({})).decode()  # publishes 2-b's new count first
        assert value(page, ADMISSION, **NO_WORKERS) == 8
        assert await _fields(redis, key, {"1-a", "2-b", RETIRED})
        for exporter in (group["1-a"], group["2-b"]):
            assert value((await exporter.page({})).decode(), ADMISSION, **NO_WORKERS) == 8
        retired = (await read_process_metrics(redis, key))[RETIRED]
        assert value(retired, ADMISSION, **NO_WORKERS) == 4
        assert "charserve_active_streams" not in retired and "process_" not in retired

        # Another one gone later adds to the same field (folded by the export loop).
        await group["2-b"].close()
        alive.discard("2-b")
        await eventually(lambda: _fields(redis, key, {"1-a", RETIRED}), timeout_s=5)
        retired = (await read_process_metrics(redis, key))[RETIRED]
        assert value(retired, ADMISSION, **NO_WORKERS) == 7
        page = (await group["1-a"].page({})).decode()
        assert value(page, ADMISSION, **NO_WORKERS) == 8
    finally:
        for member in alive:
            await group[member].close()


async def _fields(redis: aioredis.Redis, key: str, expected: set[str]) -> bool:
    return set(await process_members(redis, key)) == expected


async def test_two_processes_folding_at_once_count_a_departed_one_once(
    redis: aioredis.Redis, keys: Keys
) -> None:
    key = keys.gateway_metrics("host:8000:2")
    alive = {"1-a", "2-b"}
    a = ProcessGroupMetrics(_counted(1), redis, key, "1-a", alive=alive.__contains__)
    b = ProcessGroupMetrics(_counted(2), redis, key, "2-b", alive=alive.__contains__)
    gone = ProcessGroupMetrics(_counted(4), redis, key, "3-c", alive=alive.__contains__)
    for exporter in (a, b, gone):
        await exporter.publish()
    pages = await asyncio.gather(a.page({}), b.page({}), a.page({}), b.page({}))
    for page in pages:
        assert value(page.decode(), ADMISSION, **NO_WORKERS) == 7
    retired = (await read_process_metrics(redis, key))[RETIRED]
    assert value(retired, ADMISSION, **NO_WORKERS) == 4


async def test_one_process_publishes_nothing(redis: aioredis.Redis, keys: Keys) -> None:
    exporter = await ProcessGroupMetrics.start_for(1, 8000, GatewayMetrics(), redis, keys, "x")
    assert exporter is None
    assert await redis.keys(f"{{{keys.namespace}}}*") == []


# -- the real thing: charserve gateway, three processes on one port -----------------


@asynccontextmanager
async def gateway_processes(
    redis_url: str, keys: Keys, model_path: str, processes: int
) -> AsyncIterator[tuple[str, subprocess.Popen[bytes]]]:
    """``charserve gateway`` with ``processes`` uvicorn processes and no worker; yields its
    base URL and the supervisor. Stops the supervisor (which stops its processes) and any
    process of it still running, by pid."""
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CHARSERVE_")},
        "CHARSERVE_REDIS_URL": redis_url,
        "CHARSERVE_NAMESPACE": keys.namespace,
        "CHARSERVE_MODEL": model_path,
        "CHARSERVE_PORT": str(port),
        "CHARSERVE_GATEWAY_WORKERS": str(processes),
        "CHARSERVE_MAX_MODEL_LEN": "512",
        "CHARSERVE_HEARTBEAT_MS": "200",
        "CHARSERVE_LOG_FORMAT": "console",
    }
    command = [sys.executable, "-m", "cluster.ops.cli", "gateway"]
    proc = await asyncio.to_thread(subprocess.Popen, command, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(wait_ready, f"{base_url}/health", proc, 120)
        yield base_url, proc
    finally:
        children = _children(proc.pid)
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)
        for pid in children:  # the supervisor stops them; a straggler is stopped here
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s children (Linux's /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with suppress(OSError), open(f"/proc/{entry}/stat") as stat:
                # The fields after the command's closing parenthesis: state, ppid, ...
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


def _processes(text: str) -> set[str]:
    """The ``process`` labels on a page (one per live gateway process)."""
    return {
        s.labels[PROCESS_LABEL]
        for family in text_string_to_metric_families(text)
        if family.name == "process_start_time_seconds"
        for s in family.samples
    }


async def _refuse(base_url: str, count: int, concurrency: int = 8) -> None:
    """``count`` chat requests, each on a new connection (so the kernel hands them to any
    of the processes), all refused for want of a worker."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate, httpx.AsyncClient(base_url=base_url, timeout=30) as http:
            resp = await http.post("/v1/chat/completions", json=body)
            assert resp.status_code == 503, resp.text
            assert resp.headers["x-charserve-drop-reason"] == "no_workers"

    await asyncio.gather(*(one() for _ in range(count)))


async def _scrape(base_url: str) -> str:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:  # a new connection
        resp = await http.get("/metrics")
    assert resp.status_code == 200, resp.text
    assert_valid_exposition(resp.text)
    return resp.text


async def _counts_by_process(redis: aioredis.Redis, key: str) -> dict[str, float]:
    """What each process of the group last published (and RETIRED), from Redis itself."""
    texts = await read_process_metrics(redis, key)
    return {member: _total(text) for member, text in texts.items()}


# Four gateway processes start on two cores (three, then a replacement): minutes when busy.
@pytest.mark.timeout(600)
async def test_three_gateway_processes_on_one_port_report_one_sum(
    redis_url: str, redis: aioredis.Redis, keys: Keys, model_path: str
) -> None:
    async with gateway_processes(redis_url, keys, model_path, processes=3) as (base_url, proc):
        key = keys.gateway_metrics(
            f"{socket.gethostname()}:{base_url.rsplit(':', 1)[1]}:{proc.pid}"
        )

        async def all_three_up() -> bool:
            return len(_processes(await _scrape(base_url))) == 3

        await eventually(all_three_up, timeout_s=120, every_s=0.5)
        assert _total(await _scrape(base_url)) == 0

        sent = 90
        await _refuse(base_url, sent)

        async def summed(expected: float) -> bool:
            return _total(await _scrape(base_url)) == expected

        # Each process's counts reach the page within its export interval (5 s)...
        await eventually(lambda: summed(sent), timeout_s=20, every_s=0.5)
        # ... and from then on every scrape, whichever process answers it, shows the sum.
        for _ in range(12):
            page = await _scrape(base_url)
            assert _total(page) == sent
            assert value(page, ADMISSION, **NO_WORKERS) == sent
            assert len(_processes(page)) == 3
        by_process = await _counts_by_process(redis, key)
        assert sum(by_process.values()) == sent
        # The requests were spread: the page is a sum, not one process's count.
        assert sum(1 for n in by_process.values() if n > 0) >= 2, by_process

        # A process dies (SIGKILL: no last word); uvicorn replaces it. Its counts stay in
        # the sum (folded into RETIRED), so the counter never goes down.
        busiest = max((m for m in by_process if m != RETIRED), key=by_process.__getitem__)
        os.kill(int(member_pid(busiest)), signal.SIGKILL)

        async def replaced() -> bool:
            page = await _scrape(base_url)
            assert _total(page) == sent  # at every step
            counts = await _counts_by_process(redis, key)
            return (
                len(_processes(page)) == 3
                and member_pid(busiest) not in _processes(page)
                and busiest not in counts
                and RETIRED in counts
            )

        await eventually(replaced, timeout_s=120, every_s=0.5)
        assert (await _counts_by_process(redis, key))[RETIRED] == by_process[busiest]

        await _refuse(base_url, 30)
        await eventually(lambda: summed(sent + 30), timeout_s=20, every_s=0.5)
        for _ in range(6):
            assert _total(await _scrape(base_url)) == sent + 30
