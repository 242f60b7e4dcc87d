"""The batch runner: one asyncio task per gateway process that runs batch lines through the
same :class:`~gateway.chat.service.ChatService` as live chat, in the ``batch`` class.

Every gateway process runs one. Each polls the active batches in Redis
(:mod:`gateway.batches.store`) and moves them along:

- ``validating``: parse the input (a lock makes one process do it). A file that is not
  JSONL at all, is empty, is too long or repeats a ``custom_id`` fails the batch with
  ``errors`` (OpenAI's rule); a single bad line (not JSON, no ``custom_id``, wrong
  ``method`` or ``url``, no ``body``) becomes an error-file line with its line number, and
  the rest goes on. Then ``in_progress``.
- ``in_progress``: lease lines (at most ``max_in_flight`` per batch across all gateways,
  ``max_in_flight_per_gateway`` per process) and run them. A lease is renewed while the
  line runs; a process that dies loses its leases, and whoever takes a line over cancels
  the job its previous owner left in the queue. A line's result is recorded with
  ``HSETNX``, so it is written once even if two processes ran it. Refusals that say "not
  now" (``queue_full``, a tenant rate limit, Redis or the workers briefly away, a timeout)
  are retried after ``Retry-After`` until the batch expires; other errors are the line's
  result.
- When every line has a result: ``finalizing``, the output and error files are assembled
  in input order, then ``completed``.
- Past ``expires_at``: running lines are cancelled, the rest get ``batch_expired`` in the
  error file, then ``expired``. ``cancelling`` (the API's cancel): running lines are
  cancelled (their jobs leave the queue or are aborted in the engine); once no line holds a
  live lease, lines that never ran get ``batch_cancelled`` and the batch is ``cancelled``.
  Both keep the output of the lines that finished.

Output lines follow OpenAI's batch format: ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error": null}``. Error-file lines have the same
shape, plus ``"line"`` (1-based line number in the input file): an API error is the
``response`` with its status and OpenAI error body; a line that could not run has
``"response": null, "error": {"code", "message"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass

import structlog
from pydantic import ValidationError
from redis.exceptions import RedisError

from cluster.runtime.clock import RedisClock
from cluster.runtime.settings import Settings
from cluster.wire.queue import JobQueue
from cluster.wire.retry import hinted_retry_s
from cluster.wire.vocabulary import DropReason, ErrorCode
from gateway.batches.lines import (
    InputLine,
    ParsedInput,
    _fatal,
    api_error_line,
    assemble_files,
    error_line,
    output_line,
    parse_input,
)
from gateway.batches.objects import TEXT_ENDPOINT, BatchState
from gateway.batches.store import BatchStore
from gateway.chat.admission import classify
from gateway.chat.schemas import ChatCompletionRequest, CompletionRequest, SamplingRequest
from gateway.chat.service import ChatContext, ChatService, whole_reply
from gateway.http.errors import APIError, BadRequest

log = structlog.get_logger(__name__)

# "Not now" refusals: retried until the batch expires, never the line's result.
_TRANSIENT_CODES = frozenset(
    {
        DropReason.QUEUE_FULL,
        DropReason.RATE_LIMITED,
        DropReason.NO_WORKERS,
        ErrorCode.EXPIRED,
        ErrorCode.LOST,
        ErrorCode.CANCELLED,
        "rate_limit_exceeded",  # a tenant's limit (gateway.http.auth)
        "unavailable",  # Redis or a dependency away (503)
        "timeout",  # no reply in time (504)
    }
)
_LOCK_MS = 120_000


def _retry_after_s(exc: APIError, attempt: int, cap_s: float) -> float:
    hinted = hinted_retry_s(exc.headers) if exc.headers else None
    base = hinted if hinted is not None else 2.0 ** min(attempt, 6) * 0.25
    return min(cap_s, base) * (1.0 + random.random() * 0.2)


def _validation_message(exc: ValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return "invalid request"
    loc = ".".join(str(p) for p in errors[0]["loc"])
    text = errors[0]["msg"]
    return f"{loc}: {text}" if loc else text


@dataclass(slots=True)
class _Running:
    """A line this process runs: its task and the job id it runs under now."""

    task: asyncio.Task[None]
    job_id: str


class BatchRunner:
    """Runs the lines of every active batch; ``start()`` / ``close()`` own its tasks."""

    def __init__(
        self,
        store: BatchStore,
        chat: ChatService,
        queue: JobQueue,
        settings: Settings,
        clock: RedisClock | None = None,
    ) -> None:
        self._clock = clock or RedisClock()
        self._store = store
        self._chat = chat
        self._queue = queue
        self._settings = settings
        self._inputs: dict[tuple[str, str], ParsedInput] = {}
        self._running: dict[tuple[str, str], dict[int, _Running]] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    @property
    def in_flight(self) -> int:
        """Lines this process runs now."""
        return sum(len(lines) for lines in self._running.values())

    async def start(self) -> None:
        """Start polling and renewing."""
        self._tasks = [
            asyncio.create_task(self._poll_loop(), name="batch-poll"),
            asyncio.create_task(self._renew_loop(), name="batch-renew"),
        ]

    def wake(self) -> None:
        """Look at the batches now (a batch was created or cancelled, a line finished)."""
        self._wake.set()

    async def close(self) -> None:
        """Stop; lines still running are cancelled (their jobs too) and their leases
        released, so another gateway takes them over at once."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        running = [
            (ref, idx, r) for ref, lines in self._running.items() for idx, r in lines.items()
        ]
        for _, _, r in running:
            r.task.cancel()
        await asyncio.gather(*(r.task for _, _, r in running), return_exceptions=True)
        for (tenant, batch_id), index, r in running:
            await self._give_up(tenant, batch_id, index, r.job_id)

    # -- the loops ------------------------------------------------------------------

    async def _poll_loop(self) -> None:
        while not self._closing:
            self._wake.clear()
            try:
                await self.tick()
            except RedisError as exc:
                log.warning("batch poll failed", error=str(exc))
            except Exception:
                log.exception("batch poll failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._settings.batch_poll_ms / 1000)

    async def _renew_loop(self) -> None:
        period_s = self._settings.batch_lease_ms / 3000
        while not self._closing:
            await asyncio.sleep(period_s)
            for (tenant, batch_id), lines in list(self._running.items()):
                owned = {i: r.job_id for i, r in lines.items()}
                try:
                    lost = await self._store.renew(
                        tenant, batch_id, owned, self._settings.batch_lease_ms
                    )
                except RedisError as exc:
                    log.warning("batch lease renewal failed", error=str(exc))
                    continue
                for index in lost:
                    running = lines.get(index)
                    if running is not None and owned.get(index) == running.job_id:
                        log.info("batch line taken over", batch_id=batch_id, line=index)
                        running.task.cancel()

    async def tick(self) -> None:
        """One pass over the active batches."""
        active = await self._store.active()
        refs = set(active)
        for ref in list(self._inputs):
            if ref not in refs and not self._running.get(ref):
                self._inputs.pop(ref, None)
        for tenant, batch_id in active:
            if self._closing:
                return
            state = await self._store.batch(tenant, batch_id)
            if state is None:
                continue
            await self._advance(state)

    async def _advance(self, state: BatchState) -> None:
        ref = (state.tenant, state.id)
        expired = time.time() >= state.expires_at
        if state.status in ("validating", "in_progress") and expired:
            self._stop_lines(ref)
            await self._finish(state, "expired", fill="batch_expired")
        elif state.status == "validating":
            await self._validate(state)
        elif state.status == "in_progress":
            if await self._store.result_count(*ref) >= state.total:
                await self._finish(state, "completed")
            else:
                await self._claim(state)
        elif state.status == "finalizing":
            await self._finish(state, "completed")
        elif state.status == "cancelling":
            self._stop_lines(ref)
            if not self._running.get(ref) and await self._store.live_leases(*ref) == 0:
                await self._finish(state, "cancelled", fill="batch_cancelled")
        else:
            self._stop_lines(ref)

    def _stop_lines(self, ref: tuple[str, str]) -> None:
        for running in self._running.get(ref, {}).values():
            running.task.cancel()

    # -- validating -----------------------------------------------------------------

    async def _parsed(self, state: BatchState) -> ParsedInput | None:
        ref = (state.tenant, state.id)
        parsed = self._inputs.get(ref)
        if parsed is None:
            data = await self._store.input(*ref)
            if data is None:
                return None
            parsed = await asyncio.to_thread(
                parse_input, data, self._settings.batch_max_lines, state.endpoint
            )
            self._inputs[ref] = parsed
        return parsed

    async def _validate(self, state: BatchState) -> None:
        token = await self._store.lock(state.tenant, state.id, _LOCK_MS)
        if token is None:
            return
        try:
            parsed = await self._parsed(state)
            if parsed is None:
                parsed = ParsedInput(fatal=[_fatal("invalid_file", "the input file is gone")])
            if parsed.fatal:
                outcome = await self._store.transition(
                    state.tenant,
                    state.id,
                    ("validating",),
                    "failed",
                    "failed_at",
                    errors=json.dumps(parsed.fatal[:100]),
                )
                log.info("batch failed validation", batch_id=state.id, outcome=outcome)
                return
            for line in parsed.lines:
                if line.error_code is not None:
                    value = error_line(line, line.error_code, line.error_message or "")
                    await self._store.record(state.tenant, state.id, line.index, value, "failed")
            # Known even if the batch is cancelled meanwhile, so its counts add up.
            await self._store.set_total(state.tenant, state.id, len(parsed.lines))
            outcome = await self._store.transition(
                state.tenant, state.id, ("validating",), "in_progress", "in_progress_at"
            )
            log.info(
                "batch in progress",
                batch_id=state.id,
                tenant=state.tenant,
                total=len(parsed.lines),
                outcome=outcome,
            )
            self.wake()
        finally:
            await self._store.unlock(state.tenant, state.id, token)

    # -- running lines --------------------------------------------------------------

    async def _claim(self, state: BatchState) -> None:
        ref = (state.tenant, state.id)
        room = self._settings.batch_max_in_flight_per_gateway - self.in_flight
        if room <= 0 or self._closing:
            return
        parsed = await self._parsed(state)
        if parsed is None:
            return
        claims = await self._store.claim(
            state.tenant,
            state.id,
            room,
            self._settings.batch_max_in_flight,
            self._settings.batch_lease_ms,
        )
        lines = self._running.setdefault(ref, {})
        for claim in claims:
            if claim.previous_job_id:
                # A previous owner died or stalled: its job must not run as well.
                await self._cancel_job(claim.previous_job_id, "batch_line_taken_over")
            stale = lines.get(claim.index)
            if stale is not None:
                stale.task.cancel()  # this process's own run of it stalled past its lease
            line = parsed.lines[claim.index]
            task = asyncio.create_task(self._run_line(state, line, claim.job_id))
            lines[claim.index] = _Running(task, claim.job_id)

    async def _cancel_job(self, job_id: str, reason: str) -> None:
        try:
            await self._queue.cancel(job_id, reason)
        except RedisError as exc:
            log.warning("batch job cancel failed", job_id=job_id, error=str(exc))

    async def _give_up(self, tenant: str, batch_id: str, index: int, job_id: str) -> None:
        """Release a line this process will not finish (and make sure its job is gone)."""
        try:
            await self._queue.cancel(job_id, "batch_line_released")
            await self._store.reown(tenant, batch_id, index, job_id, "")
        except RedisError as exc:
            log.warning("batch line release failed", batch_id=batch_id, error=str(exc))

    async def _run_line(self, state: BatchState, line: InputLine, job_id: str) -> None:
        ref = (state.tenant, state.id)
        recorded = False
        try:
            value, counter = await self._execute(state, line, job_id)
            done = await self._store.record(state.tenant, state.id, line.index, value, counter)
            recorded = True
            if done == 0:
                log.info("batch line already had a result", batch_id=state.id, line=line.line_no)
        except asyncio.CancelledError:
            current = self._running.get(ref, {}).get(line.index)
            if not recorded and not self._closing and current is not None:
                if current.task is asyncio.current_task():
                    job_id = current.job_id
                await self._give_up(state.tenant, state.id, line.index, job_id)
            raise
        except RedisError as exc:
            log.warning("batch line could not be recorded", batch_id=state.id, error=str(exc))
        finally:
            lines = self._running.get(ref, {})
            mine = lines.get(line.index)
            if mine is not None and mine.task is asyncio.current_task():
                del lines[line.index]
            if not lines:
                self._running.pop(ref, None)
            self.wake()

    async def _execute(self, state: BatchState, line: InputLine, job_id: str) -> tuple[bytes, str]:
        """Run one line until it has a result: (stored value, counter to bump)."""
        ref = (state.tenant, state.id)
        assert line.body is not None
        try:
            model = CompletionRequest if state.endpoint == TEXT_ENDPOINT else ChatCompletionRequest
            request = model.model_validate({**line.body, "stream": False})
        except ValidationError as exc:
            error = BadRequest(_validation_message(exc), code="invalid_value")
            return api_error_line(line, job_id, error), "failed"
        failures = 0
        transient = 0
        while True:
            try:
                return await self._complete_once(state, request, line, job_id), "completed"
            except APIError as exc:
                retry = exc.code in _TRANSIENT_CODES or exc.status in (502, 503, 504)
                if not retry and exc.status < 500:
                    return api_error_line(line, job_id, exc), "failed"
                if retry:
                    transient += 1
                else:
                    failures += 1
                    if failures >= self._settings.batch_max_attempts:
                        return api_error_line(line, job_id, exc), "failed"
                delay_s = _retry_after_s(
                    exc, transient + failures, self._settings.batch_retry_max_s
                )
            except RedisError as exc:
                log.warning("batch line: Redis error", batch_id=state.id, error=str(exc))
                transient += 1
                delay_s = min(self._settings.batch_retry_max_s, 0.5 * transient)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("batch line failed", batch_id=state.id, line=line.line_no)
                failures += 1
                if failures >= self._settings.batch_max_attempts:
                    return error_line(
                        line, "internal_error", f"the request failed: {exc}"
                    ), "failed"
                delay_s = 1.0
            if time.time() + delay_s >= state.expires_at:
                delay_s = max(0.0, state.expires_at - time.time())
            await asyncio.sleep(delay_s)
            if time.time() >= state.expires_at:
                return error_line(line, "batch_expired", "the batch expired first"), "failed"
            # A fresh job id for each try: the last one may still be being cancelled.
            new_id = f"{job_id.rsplit('-', 1)[0]}-{transient + failures}"
            if not await self._store.reown(state.tenant, state.id, line.index, job_id, new_id):
                raise asyncio.CancelledError  # taken over by another process
            job_id = new_id
            running = self._running.get(ref, {}).get(line.index)
            if running is not None:
                running.job_id = new_id

    async def _complete_once(
        self, state: BatchState, request: SamplingRequest, line: InputLine, job_id: str
    ) -> bytes:
        now = self._clock.now_ms()
        budget_ms = max(1, state.expires_at * 1000 - now)
        # The deadline is the batch's expiry: EDF runs older batches' lines first.
        admission = classify(self._settings, now, "batch", str(budget_ms))
        ctx = ChatContext(job_id, state.tenant, admission)
        if isinstance(request, CompletionRequest):
            response = await self._chat.complete_text(request, ctx)
        else:
            assert isinstance(request, ChatCompletionRequest)
            response = await self._chat.complete(request, ctx)
        return output_line(line, job_id, whole_reply(response))

    # -- the end --------------------------------------------------------------------

    async def _finish(self, state: BatchState, to: str, fill: str | None = None) -> None:
        """Assemble the output and error files and move the batch to ``to`` (idempotent:
        file ids are derived from the batch id, so a second try rewrites the same files)."""
        token = await self._store.lock(state.tenant, state.id, _LOCK_MS)
        if token is None:
            return
        tenant, batch_id = state.tenant, state.id
        try:
            if to == "completed":
                outcome = await self._store.transition(
                    tenant, batch_id, ("in_progress", "finalizing"), "finalizing", "finalizing_at"
                )
                if outcome != "ok":
                    return
            elif fill is not None and state.total > 0:
                parsed = await self._parsed(state)
                missing = await self._store.missing(tenant, batch_id, state.total)
                message = {
                    "batch_expired": "This request could not be executed before the "
                    "completion window expired.",
                    "batch_cancelled": "The batch was cancelled before this request ran.",
                }.get(fill, fill)
                counter = "failed" if fill == "batch_expired" else ""
                for index in missing:
                    line = (
                        parsed.lines[index]
                        if parsed is not None
                        else InputLine(index, 0, None, None)
                    )
                    await self._store.record(
                        tenant, batch_id, index, error_line(line, fill, message), counter
                    )
            output, errors = assemble_files(await self._store.results(tenant, batch_id))
            fields: dict[str, str | int] = {}
            suffix = batch_id.removeprefix("batch_")
            if output:
                await self._store.put_file(
                    tenant, f"{batch_id}_output.jsonl", "batch_output", output,
                    file_id=f"file-{suffix}-output",
                )  # fmt: skip
                fields["output_file_id"] = f"file-{suffix}-output"
            if errors:
                await self._store.put_file(
                    tenant, f"{batch_id}_error.jsonl", "batch_output", errors,
                    file_id=f"file-{suffix}-errors",
                )  # fmt: skip
                fields["error_file_id"] = f"file-{suffix}-errors"
            allowed = {
                "completed": ("finalizing",),
                "expired": ("validating", "in_progress"),
                "cancelled": ("cancelling",),
            }[to]
            outcome = await self._store.transition(
                tenant, batch_id, allowed, to, f"{to}_at", **fields
            )
            log.info("batch finished", batch_id=batch_id, tenant=tenant, status=to, outcome=outcome)
        finally:
            await self._store.unlock(tenant, batch_id, token)
        self._inputs.pop((tenant, batch_id), None)
