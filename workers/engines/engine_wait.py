"""How vLLM's engine core waits for its model worker: polling with short sleeps, not a
``sched_yield`` spin.

On the CPU, vLLM runs the model in a worker process (its multiprocessing executor; the CPU
platform insists on it) and the engine core waits for each step's result on a shared-memory
queue. vLLM's reader spins (``sched_yield`` in a loop) for a second after every read, so
under load the engine core burns most of a core doing nothing while the worker computes.
On a machine whose model worker holds one core, that is the core the gateway, the replica's
output handling, Redis and Ray share: their event loops waited hundreds of ms, up to 2 s,
for the CPU, and every stream stuttered (issue 18: inter-token latency p99 3.9x vLLM's own
server's at 32 streams, and slower claims left batch slots idle).

:func:`stop_spinning` makes the engine core's queue readers sleep while vLLM would spin:
long sleeps while a step is young, then :data:`POLL_S` between looks once its result is due
(:class:`StepGaps`). A step's result is seen at most about that much later (a step takes
tens of ms here), and the core is free meanwhile. After a second without a
read they still go idle on the queue's notification socket, as vLLM's do. (Waiting on that
socket all the time is not safe: under load a notification can be lost, and the engine core
then waited for ever.) It runs in the engine core process, from the scheduler hook
(:func:`workers.engines.scheduler.latency_first_scheduler`), unless
``engine.engine_core_spin`` is on (:data:`SPIN_ENV`); the model worker's own reader (it
waits only while the engine core schedules) keeps vLLM's behaviour.

A polling engine core also runs at a higher priority (:func:`set_nice`, nice
``engine.engine_core_nice``, -10 by default when it polls): it wakes for a moment's work,
and every step waits for that work, so it must not queue behind a burst of
the gateway, the replica's output handling and Redis, which all wake at each step's end.
docs/benchmarks.md has what that did to throughput at 32 streams. The model worker keeps
its priority: it spins while it waits for the next step, and a spinning process given
priority would take its core from everything else.

vLLM's ``SpinCondition`` is a private interface: :func:`check_spin_api` says at start-up
when the installed vLLM no longer has what this relies on, and the engine then runs as
vLLM made it.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from cluster.runtime.introspect import missing_names
from workers.engines.config import NICE_ENV, SPIN_ENV

log = structlog.get_logger(__name__)

# How long a reader sleeps between looks at its queue while vLLM would spin (s), once its
# next item is due (StepGaps).
POLL_S = 0.0002
# Before that, it sleeps this share of the time left until the item is due ...
LEAD = 0.5
# ... which is the shortest of every second one of this many gaps between its last reads
# after its last read ...
GAPS = 8
# ... but never longer than this (s): a step shorter than foreseen is seen at most this late.
MAX_SLEEP_S = 0.002

# What this module relies on in vLLM's SpinCondition: its wait() reads busy_loop_s, which
# its __init__ sets (a reader spins while the last read is younger than busy_loop_s).
_WAIT_READS = ("busy_loop_s", "last_read")
_INIT_SETS = ("busy_loop_s",)


class StepGaps:
    """When a reader's next item is due, from the gaps between its last reads, and so how
    long it may sleep before it looks again.

    The engine core reads twice per step from its model worker (vLLM 0.32: the forward
    pass's reply, then the sampled tokens), so the gaps between reads alternate, long then
    short, and the next gap is like the one two reads back. A reader sleeps :data:`LEAD`
    of the time left until the shortest of those gaps (every second one of the last
    :data:`GAPS`) has passed since its last read, at most :data:`MAX_SLEEP_S`, and
    :data:`POLL_S` once that time is near or past. A step's result is still seen within
    about ``POLL_S``, with far fewer wakes than one every ``POLL_S`` (about 200 in a 58 ms
    step here, 5 ms of the engine core's CPU per token at one stream). Where the pattern
    breaks (a read outside steps, one that found its item ready and did not wait, so its gap
    spans two), short gaps fall among the long ones and the reader polls until the pattern
    is back. A step shorter than the shortest of the last few (the first decode after a
    wave of prefills, or a batch that lost many of its requests at once) is seen up to
    ``MAX_SLEEP_S`` late, once: the next gaps are shorter, and so are the next sleeps.
    """

    __slots__ = ("_gaps", "_seen")

    def __init__(self, last_read: float) -> None:
        self._gaps: deque[float] = deque(maxlen=GAPS)
        self._seen = last_read

    def sleep_s(self, last_read: float, now: float) -> float:
        """Seconds to sleep before the next look, ``now``, the last read at ``last_read``."""
        if last_read != self._seen:
            # A read since the last wait: one more gap. A read that found its item ready
            # did not wait, so a gap may span two steps; the shortest gap ignores it.
            self._gaps.append(last_read - self._seen)
            self._seen = last_read
        same_phase = list(self._gaps)[-2::-2]  # the gaps two, four, ... reads back
        if not same_phase:
            return POLL_S
        left = min(same_phase) - (now - last_read)
        return min(MAX_SLEEP_S, max(POLL_S, LEAD * left))


def spin_wanted() -> bool:
    """Whether the engine core should spin as vLLM makes it (``SPIN_ENV`` is "1")."""
    return os.environ.get(SPIN_ENV, "0") == "1"


def wanted_nice() -> int | None:
    """The nice value ``NICE_ENV`` asks for the engine core (None: leave it)."""
    value = os.environ.get(NICE_ENV, "")
    return int(value) if value else None


def set_nice(nice: int, tasks: Path = Path("/proc/self/task")) -> bool:
    """Give every thread of this process the nice value ``nice`` (on Linux a nice value
    is a thread's; threads started later inherit their starter's). True if done; False,
    logged, when the process may not (a negative value needs CAP_SYS_NICE)."""
    ids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]
    for tid in ids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except PermissionError as exc:
            log.warning("the engine core keeps its priority", nice=nice, reason=str(exc))
            return False
    log.info("the engine core runs at its nice value", nice=nice, threads=len(ids))
    return True


def check_spin_api(condition: type | None = None) -> str | None:
    """Why :func:`stop_spinning` cannot work with the installed vLLM (None: it can)."""
    if condition is None:
        try:
            from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
        except ImportError as exc:
            return f"vLLM's shared-memory queue is not where it was ({exc})"
        condition = SpinCondition
    wait = getattr(condition, "wait", None)
    init = getattr(condition, "__init__", None)
    if wait is None or init is None:
        return "vLLM's SpinCondition has no wait()"
    missing = missing_names(wait, _WAIT_READS) + missing_names(init, _INIT_SETS)
    if missing:
        return f"vLLM's SpinCondition changed (missing: {', '.join(missing)})"
    return None


def stop_spinning(condition: type | None = None) -> bool:
    """Make every queue reader of this process (those made already included) sleep between
    looks at its queue instead of spinning. True if done; False (logged once) when the
    installed vLLM does not have what this needs (logged), or it is done already."""
    problem = check_spin_api(condition)
    if problem is not None:
        log.warning("the engine core spins as vLLM made it", reason=problem)
        return False
    if condition is None:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

        condition = SpinCondition
    original: Callable[..., Any] = condition.wait  # type: ignore[attr-defined]
    if getattr(original, "_charserve_polite", False):
        return False

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        now = time.monotonic()
        if now > self.last_read + self.busy_loop_s:
            # Idle for a while: vLLM's own wait on the notification socket.
            original(self, timeout_ms)
            return
        gaps: StepGaps | None = self.__dict__.get("_charserve_gaps")
        if gaps is None:
            gaps = self.__dict__["_charserve_gaps"] = StepGaps(self.last_read)
        time.sleep(gaps.sleep_s(self.last_read, now))

    wait._charserve_polite = True  # type: ignore[attr-defined]
    condition.wait = wait  # type: ignore[attr-defined]
    log.info("the engine core polls its worker with sleeps, not spinning", poll_s=POLL_S, lead=LEAD)
    return True
