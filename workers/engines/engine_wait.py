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

:func:`stop_spinning` makes the engine core's queue readers sleep :data:`POLL_S` between
looks at the queue while vLLM would spin: a step's result is seen at most that much later
(a step takes tens of ms here), and the core is free meanwhile. After a second without a
read they still go idle on the queue's notification socket, as vLLM's do. (Waiting on that
socket all the time is not safe: under load a notification can be lost, and the engine core
then waited for ever.) It runs in the engine core process, from the scheduler hook
(:func:`workers.engines.scheduler.latency_first_scheduler`), unless
``engine.engine_core_spin`` is on (:data:`SPIN_ENV`); the model worker's own reader (it
waits only while the engine core schedules) keeps vLLM's behaviour.

A polling engine core also runs at a higher priority (:func:`set_nice`, nice
``engine.engine_core_nice``, -10 by default when it polls): it wakes every 0.2 ms for a
moment's work, and every step waits for that work, so it must not queue behind a burst of
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from cluster.runtime.introspect import missing_names
from workers.engines.config import NICE_ENV, SPIN_ENV

log = structlog.get_logger(__name__)

# How long a reader sleeps between looks at its queue while vLLM would spin (s).
POLL_S = 0.0002

# What this module relies on in vLLM's SpinCondition: its wait() reads busy_loop_s, which
# its __init__ sets (a reader spins while the last read is younger than busy_loop_s).
_WAIT_READS = ("busy_loop_s", "last_read")
_INIT_SETS = ("busy_loop_s",)


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
        if time.monotonic() > self.last_read + self.busy_loop_s:
            # Idle for a while: vLLM's own wait on the notification socket.
            original(self, timeout_ms)
        else:
            time.sleep(POLL_S)

    wait._charserve_polite = True  # type: ignore[attr-defined]
    condition.wait = wait  # type: ignore[attr-defined]
    log.info("the engine core polls its worker with sleeps, not spinning", poll_s=POLL_S)
    return True
