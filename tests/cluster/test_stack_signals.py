"""A terminal's Ctrl-C reaches only ``charserve up``: what it started ignores SIGINT or
runs in a session of its own, so the stack stops in order (cluster/ops/stack.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from cluster.ops.stack import sigint_ignored
from cluster.runtime.redis_server import RedisServer


def test_processes_started_inside_ignore_sigint() -> None:
    # As a terminal's foreground Python has it, whatever started this test (a shell's
    # background job inherits SIGINT ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with sigint_ignored():
            child = subprocess.Popen(["sleep", "30"])
        outside = subprocess.Popen(["sleep", "30"])
    finally:
        restored = signal.signal(signal.SIGINT, previous)
    try:
        assert restored is signal.default_int_handler  # sigint_ignored put it back
        for process in (child, outside):
            os.kill(process.pid, signal.SIGINT)
        time.sleep(0.3)
        assert child.poll() is None
        assert outside.poll() == -signal.SIGINT
    finally:
        for process in (child, outside):
            process.kill()
            process.wait()


def test_the_embedded_redis_runs_in_its_own_session(tmp_path: Path) -> None:
    server = RedisServer(data_dir=tmp_path).start()
    try:
        pid = server.pid
        assert pid is not None and os.getsid(pid) == pid != os.getsid(0)
    finally:
        server.stop()
