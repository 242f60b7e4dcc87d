"""Admission: a request's class and latency budget become its deadline, and a request
whose budget cannot be met is refused at once instead of left to rot in the queue.

``X-Priority: interactive|standard|batch`` picks a class (default interactive) and
``X-Latency-Budget-Ms`` overrides the class's TTFT budget. Deadline = arrival + budget; the
queue runs earliest deadline first and a worker drops a job whose deadline has passed.

The decision is a few named checks (queue bound, workers present, budget), each of which
may refuse with an enumerated reason that the client sees in ``X-Charserve-Drop-Reason``.
Batch work on the batch class's own budget (a day, by default) is never refused for
budget: it yields to everything else. A batch request that asks for a shorter budget is
judged like any other, waiting behind everything queued before it, so a budget it cannot
meet is refused at the door rather than left to expire in the queue.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace

import structlog

from cluster.runtime.clock import RedisClock
from cluster.runtime.settings import Settings
from cluster.wire.protocol import Job
from cluster.wire.queue import JobQueue
from cluster.wire.vocabulary import DropReason, PriorityClass
from gateway.chat.capacity import Capacity, CapacityView
from gateway.http.errors import APIError, BadRequest, model_not_found, refused
from gateway.metrics import GatewayMetrics

log = structlog.get_logger(__name__)

# Refusals are logged at most once per this many seconds for each reason, with the
# count since the last line: a flood of refusals is a line a second, not one each.
REFUSAL_LOG_EVERY_S = 1.0
# A job admitted this long before a worker took its figures was claimed by then if a slot
# was free: the claim follows the enqueue within a few ms, or a busy replica's next turn.
CLAIM_LAG_MS = 25
# Admissions older than this leave the count whatever the figures say (a worker whose
# figures stop moving leaves the snapshot within three beats anyway): a bound, not a rule.
UNREPORTED_MAX_AGE_MS = 5_000


@dataclass(frozen=True, slots=True)
class Admission:
    """The admitted class and deadline of one request."""

    priority_class: PriorityClass
    arrival_ms: int
    deadline_ms: int


MAX_BUDGET_MS = 365 * 86_400_000


def serves_model(served_model_name: str, adapters: frozenset[str], model: str) -> bool:
    """Whether ``model`` names the base model or an advertised LoRA adapter (vLLM's
    convention: an adapter is served under its own model name)."""
    return model == served_model_name or model in adapters


def check_model(served_model_name: str, adapters: frozenset[str], model: str) -> None:
    """404 ``model_not_found`` unless ``model`` is the served model or one of ``adapters``
    (a job for any other could never be claimed)."""
    if not serves_model(served_model_name, adapters, model):
        raise model_not_found(model)


def classify(
    settings: Settings, arrival_ms: int, priority: str | None, budget: str | None
) -> Admission:
    """Decide class and deadline from the request headers; 400 on a bad header."""
    name = (priority or PriorityClass.INTERACTIVE).strip().lower()
    if name not in PriorityClass._value2member_map_:
        raise BadRequest(
            f"X-Priority must be one of {', '.join(PriorityClass)}, not {priority!r}",
            param="X-Priority",
        )
    cls = PriorityClass(name)
    budget_ms = {
        PriorityClass.INTERACTIVE: settings.budget_interactive_ms,
        PriorityClass.STANDARD: settings.budget_standard_ms,
        PriorityClass.BATCH: settings.budget_batch_ms,
    }[cls]
    if budget is not None:
        try:
            budget_ms = int(budget)
        except ValueError:
            budget_ms = -1
        if not 0 < budget_ms <= MAX_BUDGET_MS:
            raise BadRequest(
                f"X-Latency-Budget-Ms must be a positive integer of at most {MAX_BUDGET_MS} "
                f"(a year), not {budget[:40]!r}",
                param="X-Latency-Budget-Ms",
            )
    return Admission(cls, arrival_ms, arrival_ms + budget_ms)


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a request is refused at the door, and when to come back."""

    reason: DropReason
    message: str
    retry_after_ms: float
    status: int = 429

    def error(self) -> APIError:
        """The client-facing error, with ``Retry-After`` and the drop reason."""
        return refused(self.reason, self.message, self.retry_after_ms, self.status)


class RefusalLog:
    """Logs refusals, at most one line per reason every ``every_s`` seconds, each line
    with the capacity the decision read and how many were refused since the last."""

    def __init__(self, every_s: float = REFUSAL_LOG_EVERY_S) -> None:
        self._every_s = every_s
        self._last_s: dict[DropReason, float] = {}
        self._unlogged: dict[DropReason, int] = {}  # bounded: one entry per reason

    def note(self, job: Job, rejection: Rejection, capacity: Capacity) -> None:
        """Count ``job``'s refusal; log it unless its reason was logged just now."""
        reason = rejection.reason
        refused_count = self._unlogged.get(reason, 0) + 1
        now_s = time.monotonic()
        last_s = self._last_s.get(reason)
        if last_s is not None and now_s - last_s < self._every_s:
            self._unlogged[reason] = refused_count
            return
        self._last_s[reason], self._unlogged[reason] = now_s, 0
        log.info(
            "request refused",
            reason=str(reason),
            detail=rejection.message,
            refused=refused_count,
            request_id=job.id,
            tenant=job.tenant,
            priority=str(job.priority_class),
            prompt_tokens=len(job.prompt_token_ids),
            workers=capacity.workers,
            free_slots=capacity.free_slots,
            waiting=capacity.waiting,
            prefill_ms=round(capacity.prefill_ms, 1),
            prefill_ms_per_token=round(capacity.prefill_ms_per_token, 3),
            prefill_queued_ms=round(capacity.prefill_queued_ms, 1),
        )


class RecentAdmissions:
    """What this gateway admitted that the workers' figures may not show yet.

    Admission reads a snapshot up to a refresh old, of figures a worker rewrites within
    50 ms of a claim. Judged on those alone, the requests arriving between two snapshots
    would each be judged as if it came alone: a burst is admitted whole on the figures of
    an idle cluster, however far past its budget its last request will wait, while the same
    requests spread over a second are refused from the point the figures show the work.
    Counted here, each request waits behind the chat prompt tokens admitted before it and
    finds the slots they took, whatever the arrival pattern. Per gateway: another gateway's
    admissions show once a worker has claimed them.
    """

    def __init__(self) -> None:
        # (Redis's time when admitted, chat prompt tokens): in admission order, which is
        # the clock's order but for the clock's corrections, so one pass from the front
        # drops what the figures show.
        self._entries: deque[tuple[int, int]] = deque()
        self._tokens = 0

    def add(self, at_ms: int, prompt_tokens: int) -> None:
        """Count a job admitted at ``at_ms`` whose prefill a chat would wait for
        (``prompt_tokens``; 0 for batch, whose prefills go after every chat's)."""
        self._entries.append((at_ms, prompt_tokens))
        self._tokens += prompt_tokens

    def unreported(self, reported_ms: int, now_ms: int) -> tuple[int, int]:
        """Jobs and chat prompt tokens admitted since the workers' figures were taken at
        ``reported_ms`` (less the claim lag), forgetting those admitted before."""
        cutoff = max(reported_ms - CLAIM_LAG_MS, now_ms - UNREPORTED_MAX_AGE_MS)
        entries = self._entries
        while entries and entries[0][0] <= cutoff:
            self._tokens -= entries.popleft()[1]
        return len(entries), self._tokens


def estimate_ttft_ms(
    capacity: Capacity, ahead: int, prompt_tokens: int = 0, floor_ms: float = 0.0
) -> float:
    """Estimated time to first token for a request of ``prompt_tokens`` tokens with
    ``ahead`` jobs before it.

    Its own prefill is the largest of: the workers' recent time for one short prefill;
    the prompt tokens awaiting their prefill in the engine and its own, at the workers'
    recent cost per token; and ``floor_ms`` (the least any request takes, known before any
    worker measured anything). With a free slot that is all; otherwise it first waits for
    ``ahead - free + 1`` jobs to finish at the measured drain rate (with no measured rate
    yet, the wait is unknown: only its own prefill counts).
    """
    tokens_ms = capacity.prefill_queued_ms + capacity.prefill_ms_per_token * prompt_tokens
    own = max(capacity.prefill_ms, tokens_ms, floor_ms)
    if ahead < capacity.free_slots or capacity.completed_per_s <= 0.0:
        return own
    to_finish = ahead - capacity.free_slots + 1
    return to_finish / capacity.completed_per_s * 1000.0 + own


def capped_wait_ms(capacity: Capacity, own_ahead: int, running: int, max_running: int) -> float:
    """The wait of a tenant at its cap on running jobs: its own jobs start only as its own
    running ones finish, ``max_running`` slots at the cluster's per-slot rate (0 when the
    tenant is below its cap, or no rate is known)."""
    busy = capacity.slots - capacity.free_slots
    if max_running <= 0 or running < max_running or busy <= 0:
        return 0.0
    per_slot_per_s = capacity.completed_per_s / busy
    if per_slot_per_s <= 0.0:
        return 0.0
    return (own_ahead + 1) / (max_running * per_slot_per_s) * 1000.0


class Admitter:
    """The admission decision: a few named checks, each of which may refuse."""

    def __init__(
        self,
        settings: Settings,
        queue: JobQueue,
        view: CapacityView,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self._settings = settings
        self._queue = queue
        self._view = view
        self._metrics = metrics or GatewayMetrics()
        self._refusals = RefusalLog()
        self._recent = RecentAdmissions()

    @property
    def clock(self) -> RedisClock:
        """Redis's time, as this gateway last read it (deadlines are on it)."""
        return self._view.clock

    @property
    def honours_seed(self) -> bool:
        """False when a live worker cannot honour a ``seed`` (the latest snapshot)."""
        return self._view.current.honours_seed

    @property
    def adapters(self) -> frozenset[str]:
        """The LoRA adapters some live worker serves (the latest snapshot)."""
        return self._view.current.adapters

    def check_model(self, model: str) -> None:
        """404 ``model_not_found`` unless ``model`` is the served model or a LoRA adapter
        a live worker has loaded (a job for any other could never be claimed)."""
        check_model(self._settings.served_model_name, self.adapters, model)

    def free_by_worker(self) -> dict[str, int]:
        """Free slots of each live worker, from the latest snapshot."""
        return self._view.current.free_by_worker

    async def admit(self, job: Job, max_running: int = 0) -> None:
        """Admit ``job`` (of a tenant with ``max_running`` as its cap on running jobs, 0:
        none) or raise the client-facing refusal (and count the decision)."""
        now_ms = self.clock.now_ms()
        capacity = self._with_recent(self._view.current, now_ms)
        rejection = self._queue_bound(job, capacity) or self._workers_present(job, capacity)
        if rejection is None:
            rejection = await self._budget(job, capacity, max_running)
        if rejection is not None:
            self._metrics.rejected(job.priority_class, rejection.reason)
            self._refusals.note(job, rejection, capacity)
            raise rejection.error()
        self._metrics.admitted(job.priority_class)
        batch = job.priority_class == PriorityClass.BATCH
        self._recent.add(now_ms, 0 if batch else len(job.prompt_token_ids))

    def _with_recent(self, capacity: Capacity, now_ms: int) -> Capacity:
        """``capacity`` with what this gateway admitted since the workers' figures: its
        chats' prompts are prefilled before a new one's, and its jobs hold slots the
        figures show free. Read for every request, batch too, so the count stays short."""
        jobs, tokens = self._recent.unreported(capacity.reported_ms, now_ms)
        if not jobs:
            return capacity
        return replace(
            capacity,
            free_slots=max(0, capacity.free_slots - jobs),
            prefill_queued_ms=capacity.prefill_queued_ms + capacity.prefill_ms_per_token * tokens,
        )

    def _queue_bound(self, job: Job, capacity: Capacity) -> Rejection | None:
        if capacity.waiting < self._settings.max_queued:
            return None
        return Rejection(DropReason.QUEUE_FULL, "the queue is full; try again shortly", 1000)

    def _workers_present(self, job: Job, capacity: Capacity) -> Rejection | None:
        if capacity.workers > 0 or job.priority_class == PriorityClass.BATCH:
            return None  # batch work may wait for workers to come back
        return Rejection(DropReason.NO_WORKERS, "no worker is serving right now", 5000, status=503)

    async def _budget(self, job: Job, capacity: Capacity, max_running: int) -> Rejection | None:
        budget_ms = job.deadline_ms - job.arrival_ms
        batch = job.priority_class == PriorityClass.BATCH
        if batch and budget_ms >= self._settings.budget_batch_ms:
            return None  # batch on its own budget is never refused; it yields
        ahead, capped_ms = 0, 0.0
        if capacity.waiting > 0 or capacity.free_slots == 0 or max_running > 0:
            # Under the fair share a tenant waits for its own jobs and one turn of every
            # other waiting tenant per job, not for everything queued; batch waits behind
            # every latency-bound job as well. A tenant at its cap on running jobs waits
            # for its own to finish, however free the cluster is.
            position = await self._queue.position(job)
            ahead = position.ahead if batch else position.fair_ahead
            # Free slots as the leases say now: a heartbeat reports them up to a beat
            # late, and a closed loop's requests arrive just as earlier replies free
            # their slots (a stale "none free" refused half of them).
            capacity = replace(capacity, free_slots=max(0, capacity.slots - position.claimed))
            capped_ms = capped_wait_ms(capacity, position.own_ahead, position.running, max_running)
        prompt_tokens, floor_ms = len(job.prompt_token_ids), self._settings.admission_floor_ms
        estimate = max(
            estimate_ttft_ms(capacity, ahead, prompt_tokens, floor_ms),
            capped_ms + estimate_ttft_ms(capacity, 0, prompt_tokens, floor_ms),
        )
        if estimate <= budget_ms:
            return None
        return Rejection(
            DropReason.BUDGET,
            f"the estimated time to first token ({estimate:.0f} ms, {ahead} requests ahead) "
            f"exceeds the latency budget ({budget_ms} ms)",
            # Come back when the estimate would fit, as the work ahead will have moved on
            # by the excess (the openai SDK waits exactly this, from ``retry-after-ms``),
            # but not before the next capacity snapshot, which a sooner retry would find
            # unchanged.
            max(estimate - budget_ms, self._view.refresh_ms),
        )
