"""How vLLM's engine core waits for its model worker (workers/engines/engine_wait.py).

The patch is applied to stand-in classes shaped like vLLM's ``SpinCondition`` (applying it
to vLLM's own class would change it for every later test in the session); one test checks
the installed vLLM still has what it relies on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from workers.engines import engine_wait
from workers.engines.config import NICE_ENV, POLLING_ENGINE_CORE_NICE, SPIN_ENV, EngineConfig


def _condition_class() -> type:
    """A class shaped like vLLM's SpinCondition: wait() spins while the last read is
    younger than busy_loop_s, else waits on its socket (recorded here)."""

    class Condition:
        def __init__(self, busy_loop_s: float = 1.0) -> None:
            self.busy_loop_s = busy_loop_s
            self.last_read = time.monotonic()
            self.waits: list[str] = []

        def wait(self, timeout_ms: int | None = None) -> None:
            if time.monotonic() <= self.last_read + self.busy_loop_s:
                self.waits.append("spin")
            else:
                self.waits.append(f"socket {timeout_ms}")

    return Condition


def test_the_installed_vllm_has_what_the_patch_relies_on() -> None:
    pytest.importorskip("vllm")
    assert engine_wait.check_spin_api() is None


def test_a_reader_sleeps_instead_of_spinning(monkeypatch: pytest.MonkeyPatch) -> None:
    condition = _condition_class()
    made_before: Any = condition()  # readers made before the patch are covered too
    slept: list[float] = []
    monkeypatch.setattr(engine_wait.time, "sleep", slept.append)
    assert engine_wait.stop_spinning(condition)
    made_before.wait(100)
    condition().wait(100)
    assert slept == [engine_wait.POLL_S, engine_wait.POLL_S]
    assert made_before.waits == []


def test_an_idle_reader_waits_on_its_socket_as_vllm_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    condition = _condition_class()
    assert engine_wait.stop_spinning(condition)
    reader: Any = condition()
    reader.last_read -= 2 * reader.busy_loop_s
    slept: list[float] = []
    monkeypatch.setattr(engine_wait.time, "sleep", slept.append)
    reader.wait(250)
    assert reader.waits == ["socket 250"]
    assert slept == []


def test_patching_twice_wraps_once() -> None:
    condition = _condition_class()
    assert engine_wait.stop_spinning(condition)
    patched = condition.wait  # type: ignore[attr-defined]
    assert not engine_wait.stop_spinning(condition)
    assert condition.wait is patched  # type: ignore[attr-defined]


def test_a_changed_vllm_is_left_as_it_is() -> None:
    class Renamed:
        def __init__(self) -> None:
            self.spin_window_s = 1.0

        def wait(self, timeout_ms: int | None = None) -> None:
            del timeout_ms

    original = Renamed.wait
    problem = engine_wait.check_spin_api(Renamed)
    assert problem is not None and "busy_loop_s" in problem
    assert not engine_wait.stop_spinning(Renamed)
    assert Renamed.wait is original


@pytest.mark.parametrize(
    ("device", "setting", "spins"),
    [("cpu", None, False), ("cuda", None, True), ("cpu", True, True), ("cuda", False, False)],
)
def test_the_engine_core_spins_on_cuda_and_sleeps_on_the_cpu_by_default(
    device: str, setting: bool | None, spins: bool
) -> None:
    config = EngineConfig(device=device, engine_core_spin=setting)
    assert config.spins() is spins
    assert config.env()[SPIN_ENV] == ("1" if spins else "0")


def test_the_setting_reaches_the_engine_core_through_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(SPIN_ENV, raising=False)
    assert not engine_wait.spin_wanted()
    monkeypatch.setenv(SPIN_ENV, "1")
    assert engine_wait.spin_wanted()


@pytest.mark.parametrize(
    ("device", "spin", "nice", "expected"),
    [
        ("cpu", None, None, POLLING_ENGINE_CORE_NICE),  # polls: raised
        ("cuda", None, None, None),  # spins: left as it is
        ("cpu", True, None, None),
        ("cuda", None, 5, 5),  # as configured
        ("cpu", None, 0, 0),
    ],
)
def test_a_polling_engine_core_runs_at_a_raised_priority_by_default(
    device: str, spin: bool | None, nice: int | None, expected: int | None
) -> None:
    config = EngineConfig(device=device, engine_core_spin=spin, engine_core_nice=nice)
    assert config.core_nice() == expected
    assert config.env().get(NICE_ENV) == (None if expected is None else str(expected))


def test_a_nice_value_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="engine_core_nice"):
        EngineConfig(engine_core_nice=-21)


def test_the_nice_value_reaches_the_engine_core_through_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(NICE_ENV, raising=False)
    assert engine_wait.wanted_nice() is None
    monkeypatch.setenv(NICE_ENV, "-10")
    assert engine_wait.wanted_nice() == -10


# Run in a process of its own: a nice value once raised cannot be lowered again without
# the privilege, and must not stay on the test session.
_EVERY_THREAD = """
import json, os, threading
from workers.engines import engine_wait

def nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

started, stop, seen = threading.Event(), threading.Event(), {}
def before() -> None:
    started.set()
    stop.wait()
    seen["before"] = nice()
thread = threading.Thread(target=before)
thread.start()
started.wait()
seen["ok"] = engine_wait.set_nice(min(nice() + 3, 19))
later = threading.Thread(target=lambda: seen.__setitem__("later", nice()))
later.start()
later.join()
stop.set()
thread.join()
seen["main"] = nice()
print(json.dumps(seen))
"""


def test_every_thread_of_the_engine_core_gets_the_nice_value() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _EVERY_THREAD],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # The child starts at this process's nice value.
    want = min(os.getpriority(os.PRIO_PROCESS, 0) + 3, 19)
    # The thread running before the call, the caller, and a thread started after it.
    assert seen == {"ok": True, "before": want, "later": want, "main": want}


def test_without_the_privilege_the_engine_core_runs_on(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(which: int, who: int, value: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(engine_wait.os, "setpriority", refuse)
    assert not engine_wait.set_nice(-10)
