"""A step log: one line per engine step, what vLLM's scheduler put in it.

Off unless ``CHARSERVE_STEP_LOG`` names a directory in the engine core's environment
(``CHARSERVE_STEP_LOG=DIR charserve up``, or ``charserve bench-peers --step-log``). Then
charserve's scheduler hook (:func:`workers.engines.scheduler.latency_first_scheduler`)
builds its scheduler with :func:`with_step_log`, and vLLM's own server records the same
with ``--scheduler-cls workers.engines.steplog.LoggingScheduler``: the two servers' steps
are then read alike (:mod:`cluster.runtime.steplog` has the format,
:mod:`cluster.bench.steps` what it shows).

A step costs one short line written and flushed (microseconds; a step takes tens of ms
on a CPU), so a run measured with it on is still the server's. It is a diagnostic for
benchmarks, not a production log: nothing rotates it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import IO, Any, TypeVar

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler

from cluster.runtime.steplog import STEP_LOG_ENV, Step, line

S = TypeVar("S", bound=type[Scheduler])


class StepRecorder:
    """Writes one line per step that schedules anything, into ``directory``'s
    ``steps-PID.tsv`` (opened at the first such step)."""

    def __init__(self, directory: Path) -> None:
        self._path = directory / f"steps-{os.getpid()}.tsv"
        self._file: IO[str] | None = None

    def record(self, output: SchedulerOutput) -> None:
        """Log what ``output`` (one step's schedule) holds; an empty step is skipped."""
        total = output.total_num_scheduled_tokens
        if not total:
            return
        new = output.scheduled_new_reqs
        tokens = output.num_scheduled_tokens
        step = Step(
            time.monotonic(),
            total,
            len(new),
            sum(tokens.get(r.req_id, 0) for r in new),
            len(tokens),
        )
        if self._file is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self._path.open("a", encoding="utf-8")
        self._file.write(line(step))
        self._file.flush()  # a server stopped by a signal leaves every step it ran


def from_environment() -> StepRecorder | None:
    """The recorder ``CHARSERVE_STEP_LOG`` asks for, or None."""
    directory = os.environ.get(STEP_LOG_ENV, "")
    return StepRecorder(Path(directory)) if directory else None


def with_step_log(cls: S) -> S:
    """A subclass of the scheduler ``cls`` that logs each step it schedules."""

    class Logged(cls):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # Built in the engine core's process, so its environment (None: the log is off).
            self._step_recorder = from_environment()

        def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
            output = super().schedule(*args, **kwargs)
            if self._step_recorder is not None:
                self._step_recorder.record(output)
            return output

    Logged.__name__ = Logged.__qualname__ = f"StepLogged{cls.__name__}"
    return Logged  # type: ignore[return-value]


# vLLM's own scheduler, logged: ``--scheduler-cls workers.engines.steplog.LoggingScheduler``
# for vLLM's server (its steps are then vLLM's, recorded as charserve's are).
LoggingScheduler = with_step_log(Scheduler)
