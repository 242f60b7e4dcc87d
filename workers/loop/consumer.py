"""The consumer loop: claim jobs from Redis only while the engine has free batch slots,
run them, stream their chunks back, and keep their leases alive.

Why claim only with free slots: the order of work is decided in Redis, where the
deadlines are. If a replica pulled more than it can batch, vLLM's own waiting queue
would hold work that another, idle replica could have started. The loop wakes within a
round trip of an enqueue (``BLPOP`` on the wake list), and the moment a slot frees it
claims again, so continuous batching stays full. That claim's round trip misses the engine
step that started as the slot freed; ``claim_ahead`` jobs beyond the slots wait in the
engine's own queue, so a freed slot is refilled in the very next step.

With tracing on (``CHARSERVE_TRACING`` in the replica's environment) a job that carries a
``traceparent`` runs in a span of its own, a child of its gateway's span: from the claim
to the ack, with the prefill (claim to first token) under it and the first publish and
the end of generation as events. The engine is handed that span's ``traceparent``, for
its own spans to nest under it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import os
import socket
import time
import uuid

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from cluster.runtime import tracing
from cluster.runtime.clock import RedisClock
from cluster.runtime.prometheus import run_worker_exporter
from cluster.runtime.redis_client import connect
from cluster.runtime.tracing import Trace, Tracing
from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.presence import Presence
from cluster.wire.protocol import Cancel, Job, WorkerStats
from cluster.wire.queue import JobQueue, Poison
from cluster.wire.vocabulary import ErrorCode
from workers.engines.base import Engine, EngineOutput, engine_priority, run_generation
from workers.errors import ExpiredJobError, JobError
from workers.loop.acks import AckBatcher
from workers.loop.config import ConsumerConfig
from workers.loop.metrics import WorkerMetrics, render_worker_metrics
from workers.loop.pacing import StartPacer
from workers.loop.prefill import PrefillMeter
from workers.loop.publisher import Publisher, RequestStream
from workers.loop.recovery import Recovery
from workers.loop.reserve import BatchReserve

log = structlog.get_logger(__name__)

# The window the reported completion rate is smoothed over (s).
COMPLETION_RATE_WINDOW_S = 5.0
# Between two beats a worker rewrites its stats when the jobs awaiting their first token
# change, at most once per this many seconds: a count a beat old (1 s) went on refusing a
# closed loop's every request for the rest of the beat after the prefills had drained.
STATS_REFRESH_S = 0.05


def new_worker_id() -> str:
    """A worker id that is unique across hosts and restarts."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Consumer:
    """Claims and runs jobs for one engine. ``start()`` / ``close()`` own its tasks."""

    def __init__(
        self,
        redis_url: str,
        keys: Keys,
        engine: Engine,
        config: ConsumerConfig,
        worker_id: str | None = None,
        clock: RedisClock | None = None,
        traces: Tracing | None = None,
    ) -> None:
        self.worker_id = worker_id or new_worker_id()
        # None: as CHARSERVE_TRACING says, read at start() (off when unset).
        self._tracing = traces
        # Deadlines and heartbeats are judged on Redis's clock, never this machine's.
        self._clock = clock or RedisClock()
        self._url = redis_url
        self._keys = keys
        self._engine = engine
        self._config = config
        self._redis: aioredis.Redis | None = None
        self._blocking: aioredis.Redis | None = None
        self._queue: JobQueue | None = None
        self._acks: AckBatcher | None = None
        self._presence: Presence | None = None
        self._publisher: Publisher | None = None
        self._running: dict[str, asyncio.Task[None]] = {}
        self._jobs: dict[str, Job] = {}
        self._batch_running: set[str] = set()
        self._pacer = StartPacer(config.batch_starts_per_s, config.batch_start_burst)
        self._reserve = BatchReserve(
            config.batch_reserve_slots, config.batch_reserve_min, config.batch_reserve_window_s
        )
        self._handing_back = False
        self._lease_lost: set[str] = set()
        # Cancels that arrived for jobs not registered yet (their claim's reply was still
        # on its way), by id, with when they stop mattering (monotonic s).
        self._early_cancels: dict[str, float] = {}
        # Set by close(): the background loops finish their current Redis command and
        # stop, rather than being cancelled in the middle of one (a command cancelled
        # midway can leave its connection unusable, and the client's close then hangs).
        self._closing = asyncio.Event()
        self._recovery: Recovery | None = None
        self._slot_freed = asyncio.Event()
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self._claimed_total = 0
        self._tokens_since_beat = 0
        self._completed_since_beat = 0
        self._completed_per_s = 0.0  # smoothed (COMPLETION_RATE_WINDOW_S)
        # The jobs submitted to the engine that have no first token yet, and what their
        # prefills took.
        self._prefilling = PrefillMeter()
        self._prefilling_changed = asyncio.Event()
        self._stats: WorkerStats | None = None  # as the last beat wrote them
        self._last_beat_s = time.monotonic()
        self.metrics = WorkerMetrics()
        self.metrics.bind(inflight=lambda: len(self._running), slots=lambda: engine.max_slots)

    @property
    def running(self) -> int:
        """Jobs running now."""
        return len(self._running)

    @property
    def alive(self) -> bool:
        """True while every background task is still running."""
        return bool(self._tasks) and not any(t.done() for t in self._tasks)

    async def start(self) -> None:
        """Connect, announce this worker, and start claiming."""
        if self._tracing is None:
            self._tracing = tracing.from_environment(tracing.WORKER_SERVICE)
        self._redis = connect(self._url)
        self._blocking = connect(self._url, blocking=True)
        self._queue = JobQueue(self._redis, self._keys, self._config.queue_policy)
        self._acks = AckBatcher(self._queue, self.worker_id)
        self._presence = Presence(self._redis)
        self._publisher = Publisher(
            self._redis,
            self._keys,
            interval_ms=self._config.publish_interval_ms,
            reply_log_ttl_s=self._config.reply_log_ttl_s,
            reply_log_maxlen=self._config.reply_log_max_chunks,
            worker_id=self.worker_id,
        )
        self._publisher.on_fenced = self._abandon
        self._publisher.on_gateway_gone = self._gateway_gone
        self._recovery = Recovery(
            self._redis,
            self._keys,
            self._queue,
            self._publisher,
            self.worker_id,
            self._config.max_attempts,
        )
        await self._publisher.start()
        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self._keys.control(self.worker_id))
        await self._beat()
        self._tasks = [
            asyncio.create_task(self._claim_loop(), name="claim"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._stats_loop(), name="stats"),
            asyncio.create_task(self._control_loop(pubsub), name="control"),
            asyncio.create_task(
                run_worker_exporter(
                    self._redis,
                    self._keys.worker_metrics(self.worker_id),
                    lambda: render_worker_metrics(self.metrics),
                    stop=self._closing,
                ),
                name="metrics",
            ),
        ]
        log.info("consumer started", worker_id=self.worker_id, slots=self._engine.max_slots)

    async def close(self) -> None:
        """Stop claiming, let running jobs finish (up to the drain timeout), hand the rest
        back to the queue, then stop."""
        self._stopping = True
        claim = self._tasks[0] if self._tasks else None
        if claim is not None:
            claim.cancel()
            await asyncio.gather(claim, return_exceptions=True)
        if self._running:
            log.info("draining", running=len(self._running))
            await asyncio.wait(list(self._running.values()), timeout=self._config.drain_timeout_s)
        if self._running:
            # Out of time: hand what still runs back to the queue; another worker
            # continues each reply where it stopped.
            log.warning("handing back unfinished jobs", running=len(self._running))
            self._handing_back = True
            for task in list(self._running.values()):
                task.cancel()
            await asyncio.gather(*self._running.values(), return_exceptions=True)
        if self._acks is not None:
            await self._acks.close()
        self._closing.set()
        self._prefilling_changed.set()  # wakes the stats loop to stop
        if self._tasks[1:]:
            await asyncio.wait(self._tasks[1:], timeout=10)
        for task in self._tasks[1:]:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._publisher is not None:
            await self._publisher.close()
        if self._redis is not None:
            try:
                await asyncio.wait_for(self._redis.zrem(self._keys.workers, self.worker_id), 5)
            except (RedisError, TimeoutError):
                pass
        for client in (self._redis, self._blocking):
            if client is not None:
                try:
                    await asyncio.wait_for(client.aclose(), 5)
                except TimeoutError:
                    log.warning("a Redis client did not close in time")
        if self._tracing is not None:
            # Spans of the last jobs are exported now, not at exit (a replica may be killed).
            await asyncio.to_thread(self._tracing.flush)
        log.info("consumer stopped", worker_id=self.worker_id)

    # -- claiming -------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        assert self._queue is not None and self._blocking is not None
        while not self._stopping:
            self._slot_freed.clear()
            free = self._engine.max_slots + self._config.claim_ahead - len(self._running)
            if free <= 0:
                await self._slot_freed.wait()
                continue
            batch_room = min(
                self._engine.max_slots - self._reserve.slots() - len(self._batch_running),
                self._pacer.available(),
            )
            try:
                claimed = await self._queue.claim(
                    self.worker_id, free, self._config.lease_ms, batch_room, self._engine.adapters
                )
                self._clock.observe(claimed.now_ms)
            except RedisError as exc:
                log.warning("claim failed", error=str(exc))
                await asyncio.sleep(0.5)
                continue
            for job in claimed.jobs:
                if isinstance(job, Poison):
                    await self._recover_safely(job)
                    continue
                self._claimed_total += 1
                self.metrics.claimed(job.priority_class)
                if not job.latency_bound:
                    self._batch_running.add(job.id)
                    self._pacer.take(1)
                task = asyncio.create_task(self._run(job, claimed.now_ms), name=f"job-{job.id}")
                self._running[job.id] = task
                self._jobs[job.id] = job
                if self._early_cancels.pop(job.id, None) is not None:
                    # Its cancel arrived before the claim's reply did.
                    task.cancel()
            if claimed.jobs:
                self._note_demand()
                # Let each new job's task hand its job to the engine before the next
                # claim's script is packed and sent: that work sat in front of the job's
                # first step (at one stream, about half a millisecond of its TTFT).
                await asyncio.sleep(0)
            if claimed.jobs and not claimed.drained:
                continue
            # Nothing this worker may take, or nothing left waiting at all (then another
            # claim could only come back empty): wake on an enqueue, whose token lands
            # after the claim, or when paced batch work may start again.
            try:
                await self._queue.wait_for_work(
                    self._blocking,
                    timeout_s=min(1.0, self._pacer.wait_s() or 1.0),
                    worker_id=self.worker_id,
                    adapters=self._engine.adapters,
                )
            except RedisError as exc:
                log.warning("wait for work failed", error=str(exc))
                await asyncio.sleep(0.5)

    def _note_demand(self) -> None:
        """Tell the reserve how many latency-bound jobs run now."""
        self._reserve.note(len(self._running) - len(self._batch_running))

    async def _run(self, job: Job, claimed_ms: int) -> None:
        assert self._publisher is not None and self._acks is not None
        structlog.contextvars.bind_contextvars(request_id=job.id, tenant=job.tenant)
        stream = RequestStream(
            job=job,
            worker_id=self.worker_id,
            queue_ms=float(claimed_ms - job.arrival_ms),
            completion_tokens=len(job.resume_token_ids),
        )
        engine_job = job
        if self._tracing is not None and job.traceparent:
            stream.trace = self._trace_job(self._tracing, job, stream.queue_ms)
            # vLLM's own spans (when its tracing is on) nest under this worker's.
            engine_job = dataclasses.replace(job, traceparent=stream.trace.traceparent)
        started_s = time.perf_counter()
        self._prefilling.started(
            job.id,
            len(job.prompt_token_ids),
            # Admission estimates latency-bound work: long batch prefills (multi-turn
            # backfills) must not make it look infeasible.
            chat=job.latency_bound,
            now_s=time.monotonic(),
        )
        self._prefilling_changed.set()
        handed_back = False
        outcome = "completed"
        try:
            # A retry, or a reply a stopping replica handed back mid-stream, already met (or
            # missed) its budget on its first worker: finish it.
            if job.first_try and claimed_ms > job.deadline_ms:
                raise ExpiredJobError(
                    f"the request waited {claimed_ms - job.arrival_ms} ms in the queue, "
                    "past its latency budget"
                )
            await run_generation(
                self._engine,
                engine_job,
                engine_priority(job),
                functools.partial(self._on_output, stream, started_s),
            )
            if not stream.finished:
                stream.finish_reason = "stop"
                self._publisher.mark(stream)
        except asyncio.CancelledError:
            await self._engine.abort(job.id)
            if job.id in self._lease_lost:
                outcome = "lease_lost"
            elif self._handing_back:
                handed_back, outcome = True, "handed_back"
            else:
                outcome = "cancelled"
                self._fail(stream, ErrorCode.CANCELLED, "the request was cancelled")
        except JobError as exc:
            outcome = exc.code
            self._fail(stream, exc.code, str(exc))
        except Exception as exc:  # an engine failure ends this job, not the worker
            log.exception("job failed")
            outcome = "error"
            self._fail(stream, ErrorCode.INTERNAL, f"generation failed: {exc}")
        finally:
            if outcome != ErrorCode.EXPIRED:
                # A job dropped unrun (late) freed no engine slot: it is not throughput,
                # and counting it would tell admission the cluster drains faster in a flood.
                self._completed_since_beat += 1
            self._running.pop(job.id, None)
            if self._prefilling.ended(job.id):
                self._prefilling_changed.set()
            self._jobs.pop(job.id, None)
            self._batch_running.discard(job.id)
            self._note_demand()
            self._slot_freed.set()
        if stream.trace is not None:
            stream.trace.event(
                "generation end",
                {
                    "charserve.outcome": outcome,
                    "charserve.finish_reason": stream.finish_reason or "",
                    "gen_ai.usage.output_tokens": stream.completion_tokens,
                },
            )
        try:
            if outcome == "lease_lost":
                self._lease_lost.discard(job.id)
                self._publisher.discard(job.id)
            elif handed_back:
                await self._hand_back(stream)
            else:
                await asyncio.wait_for(stream.done.wait(), timeout=30.0)
                generated = stream.completion_tokens - len(job.resume_token_ids)
                if not await self._acks.ack(job.id, generated):
                    # Between the final publish and the ack another worker took the
                    # lease: its recovery finds the final chunk in the log and ends there.
                    self.metrics.lease_lost()
                    log.warning("ack refused: the lease is no longer ours", request_id=job.id)
        except (TimeoutError, RedisError) as exc:
            # The lease will expire and the job is requeued: never silently lost.
            log.warning("could not finish job", error=str(exc))
        # A latency-bound job done at its first try is the gateway's `request finished`
        # line (same request id, outcome, worker, queue and prefill times, tokens): its own
        # line here is debug. Each line a replica writes costs Ray's forwarding to the
        # driver about 0.1 ms of CPU on the head node. Anything else is worth a line.
        routine = outcome == "completed" and job.first_try and job.latency_bound
        log.log(
            logging.DEBUG if routine else logging.INFO,
            "job finished",
            outcome=outcome,
            priority=job.priority_class,
            attempt=job.attempt,
            queue_ms=round(stream.queue_ms, 1),
            prefill_ms=round(stream.prefill_ms, 1),
            run_ms=round((time.perf_counter() - started_s) * 1000.0, 1),
            prompt_tokens=len(job.prompt_token_ids),
            completion_tokens=stream.completion_tokens,
        )
        if stream.trace is not None:
            # Cancelled, handed back or taken over are not failures of this job's reply.
            failed = outcome not in ("completed", "cancelled", "handed_back", "lease_lost")
            stream.trace.end(error=(stream.error_message or outcome) if failed else None)
        structlog.contextvars.unbind_contextvars("request_id", "tenant")

    def _trace_job(self, traces: Tracing, job: Job, queue_ms: float) -> Trace:
        """The job's span on this worker, a child of its gateway's (``job.traceparent``)."""
        return traces.start(
            "job",
            parent=job.traceparent,
            kind="consumer",
            attributes={
                "charserve.request_id": job.id,
                "charserve.worker_id": self.worker_id,
                "charserve.priority": job.priority_class,
                "charserve.attempt": job.attempt,
                "charserve.queue_ms": queue_ms,
                "gen_ai.usage.input_tokens": len(job.prompt_token_ids),
                "gen_ai.request.max_tokens": job.max_tokens,
            },
        )

    def _on_output(self, stream: RequestStream, started_s: float, out: EngineOutput) -> None:
        """Take one engine output of ``stream``'s job: called once per step and request,
        so it does only what each token needs."""
        assert self._publisher is not None
        if stream.seq == 0 and not stream.pending_ids:
            stream.prefill_ms = (time.perf_counter() - started_s) * 1000.0
            uncached = len(stream.job.prompt_token_ids) - out.cached_tokens
            self._prefilling.first_token(
                stream.job.id, stream.prefill_ms, uncached, time.monotonic()
            )
            self._prefilling_changed.set()
            if stream.trace is not None:
                now_ns = time.time_ns()
                stream.trace.child(
                    "prefill",
                    now_ns - int(stream.prefill_ms * 1_000_000),
                    now_ns,
                    {"gen_ai.usage.cached_tokens": out.cached_tokens},
                )
        stream.add(out)
        self._tokens_since_beat += len(out.token_ids)
        self._publisher.mark(stream)

    async def _hand_back(self, stream: RequestStream) -> None:
        """Requeue a job this worker is giving up on (shutdown), after its pending text
        is in the log, so the next worker continues exactly where it stopped."""
        assert self._publisher is not None and self._recovery is not None
        await self._publisher.flush()  # every output was marked as it arrived
        outcome = await self._recovery.recover(stream.job, count_attempt=False)
        self.metrics.recovered(outcome, handback=True)
        log.info("job handed back", request_id=stream.job.id, outcome=outcome)

    async def _recover_safely(self, job: Job | Poison) -> None:
        assert self._recovery is not None
        try:
            if isinstance(job, Poison):
                await self._recovery.poison(job)
                self.metrics.poisoned()
            else:
                self.metrics.recovered(await self._recovery.recover(job))
        except (TimeoutError, RedisError, protocol.ProtocolError) as exc:
            # Our lease on it expires in turn and another worker tries again.
            log.warning("recovery failed", request_id=job.id, error=str(exc))

    def _abandon(self, job_ids: list[str]) -> None:
        """Give up jobs whose lease is no longer this worker's (found at renewal, or by
        the publisher's lease fence), silently: each new owner continues its reply from
        the log."""
        assert self._publisher is not None
        self.metrics.lease_lost(len(job_ids))
        for job_id in job_ids:
            task = self._running.get(job_id)
            if task is not None and job_id not in self._lease_lost:
                log.warning("lease lost, abandoning job", request_id=job_id)
                self._lease_lost.add(job_id)
                self._publisher.discard(job_id)
                task.cancel()

    def _gateway_gone(self, channels: list[str]) -> None:
        """Stop the jobs only a gateway that is gone would have relayed (their replies
        reach nobody; a resumable one runs on, for its client to read from the log)."""
        gone = set(channels)
        for job_id, task in list(self._running.items()):
            job = self._jobs.get(job_id)
            if job is not None and job.reply_to in gone and not job.resumable:
                log.info("cancelling: its gateway is gone", request_id=job_id)
                task.cancel()

    def _note_early_cancel(self, job_id: str) -> None:
        """Remember a cancel for a job this worker may be about to register."""
        now = time.monotonic()
        if len(self._early_cancels) > 1024:
            self._early_cancels = {j: t for j, t in self._early_cancels.items() if t > now}
        self._early_cancels[job_id] = now + 30.0

    def _fail(self, stream: RequestStream, code: str, message: str) -> None:
        assert self._publisher is not None
        stream.fail(code, message)
        self._publisher.mark(stream)

    # -- control and heartbeat ------------------------------------------------------

    async def _control_loop(self, pubsub: aioredis.client.PubSub) -> None:
        while not self._closing.is_set():
            try:
                message = await pubsub.get_message(timeout=1.0)
            except RedisError as exc:
                log.warning("control channel failed", error=str(exc))
                await asyncio.sleep(0.5)
                continue
            if message is None:
                continue
            try:
                cancel = protocol.decode_as(message["data"], Cancel)
            except protocol.ProtocolError as exc:
                log.warning("bad control message", error=str(exc))
                continue
            task = self._running.get(cancel.request_id)
            if task is not None:
                log.info("cancelling", request_id=cancel.request_id, reason=cancel.reason)
                task.cancel()
            else:
                self._note_early_cancel(cancel.request_id)
        try:
            await asyncio.wait_for(pubsub.aclose(), 5)
        except (RedisError, TimeoutError):
            pass

    async def _heartbeat_loop(self) -> None:
        period_s = min(self._config.heartbeat_ms, self._config.lease_ms // 3) / 1000.0
        while True:
            try:
                await asyncio.wait_for(self._closing.wait(), period_s)
                return
            except TimeoutError:
                pass
            try:
                await self._beat()
            except RedisError as exc:
                log.warning("heartbeat failed", error=str(exc))

    async def _stats_loop(self) -> None:
        """Rewrite the last beat's stats with the prefills as they are now, soon after
        they change (admission counts the prompt tokens they hold)."""
        while True:
            await self._prefilling_changed.wait()  # close() sets it too
            if not self._closing.is_set():
                await asyncio.sleep(STATS_REFRESH_S)  # one write for a burst of changes
            if self._closing.is_set():
                return
            self._prefilling_changed.clear()
            # start() beat once before this loop began: both are set.
            assert self._stats is not None and self._redis is not None
            stats = self._live(self._stats, time.monotonic())
            try:
                await self._write_stats(stats, None)
            except RedisError as exc:
                log.warning("stats refresh failed", error=str(exc))

    def _live(self, stats: WorkerStats, now_s: float) -> WorkerStats:
        """``stats`` with the figures that change between beats as they are now (the jobs
        running, draining, the prefill a request arriving now would see), and when."""
        prefill = self._prefilling.report(now_s)
        return dataclasses.replace(
            stats,
            running=len(self._running),
            draining=self._stopping,
            prefill_ms=prefill.prefill_ms,
            prefill_ms_per_token=prefill.prefill_ms_per_token,
            prefill_queued_ms=prefill.prefill_queued_ms,
            at_ms=self._clock.now_ms(),
        )

    async def _write_stats(self, stats: WorkerStats, ts_ms: int | None) -> int:
        """Write ``stats`` (and, given ``ts_ms``, the beat's score); Redis's time in ms."""
        assert self._presence is not None
        return await self._presence.beat(
            self._keys.workers,
            self._keys.worker_stats(self.worker_id),
            self.worker_id,
            protocol.encode(stats),
            self._stats_ttl_ms(),
            ts_ms,
        )

    def _stats_ttl_ms(self) -> int:
        """How long a stats record lives: gateways judge freshness by the heartbeat score;
        the stats only need to outlive a late beat (a loaded machine delays short periods
        the most)."""
        return max(self._config.heartbeat_ms * 3, 3000)

    def _completion_rate(self, rate: float, elapsed_s: float) -> float:
        """Jobs finished per second, smoothed over about COMPLETION_RATE_WINDOW_S: a beat
        in which none of a few long jobs happened to end does not read as "no drain".
        The first rate measured is taken whole (a smoothed rise from zero would read as a
        drain far slower than the engine's), and an idle worker keeps its last rate: no
        work finishing is not a slow drain."""
        if rate <= 0.0 and not self._running:
            return self._completed_per_s
        if self._completed_per_s <= 0.0:
            self._completed_per_s = rate
            return rate
        weight = 1.0 - math.exp(-elapsed_s / COMPLETION_RATE_WINDOW_S)
        self._completed_per_s += weight * (rate - self._completed_per_s)
        return self._completed_per_s

    async def _beat(self) -> None:
        assert self._redis is not None and self._queue is not None
        now_s = time.monotonic()
        elapsed = max(1e-3, now_s - self._last_beat_s)
        rates = WorkerStats(
            worker_id=self.worker_id,
            max_slots=self._engine.max_slots,
            running=0,  # _live sets it, with the other figures that change between beats
            ts_ms=self._clock.now_ms(),
            decode_tokens_per_s=self._tokens_since_beat / elapsed,
            claimed_total=self._claimed_total,
            completed_per_s=self._completion_rate(self._completed_since_beat / elapsed, elapsed),
            honours_seed=self._engine.honours_seed,
            adapters=sorted(self._engine.adapters),
        )
        stats = self._live(rates, now_s)
        self._tokens_since_beat, self._completed_since_beat = 0, 0
        self._last_beat_s = now_s
        self._stats = stats
        # Through a full Redis too (see cluster.wire.presence), as the lease renewal below.
        self._clock.observe(await self._write_stats(stats, stats.ts_ms))
        lost = await self._queue.renew(self.worker_id, list(self._running), self._config.lease_ms)
        self._abandon(lost)
        if not self._stopping:
            for orphan in await self._queue.reclaim_expired(self.worker_id, self._config.lease_ms):
                self.metrics.lease_expired()
                await self._recover_safely(orphan)
