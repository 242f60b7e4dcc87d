"""The full stack for end-to-end tests: ``charserve up`` as a real subprocess (Ray, the
Serve deployment with the vLLM CPU engine and the bundled model, the gateway), against a
redis-server this session owns so tests can look inside it. One stack per test session;
stopping it must leave no process behind. A module that needs another configuration
starts its own with :func:`start_stack`, which stops the one running first: one engine at
a time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from cluster.runtime.net import free_port

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 600


@dataclass
class Stack:
    """A running ``charserve up``."""

    base_url: str
    redis_url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    stopped: bool = False
    leftovers: list[str] = field(default_factory=list)

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout_s: float = 180) -> int:
        """SIGTERM, as an operator would; record any process still alive afterwards."""
        if self.stopped:
            return self.proc.returncode or 0
        family = self.descendants()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        _, alive = psutil.wait_procs(family, timeout=30)
        self.leftovers = [f"{p.pid} {_name(p)}" for p in alive]
        for p in alive:  # never leave them running, even when the test fails
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.stopped = True
        return code


def _name(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:120]
    except psutil.Error:
        return "?"


def _wait_ready(stack: Stack) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if stack.proc.poll() is not None:
            raise RuntimeError(
                f"charserve up exited with {stack.proc.returncode}:\n"
                + stack.log_path.read_text()[-4000:]
            )
        try:
            with urllib.request.urlopen(f"{stack.base_url}/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError("the stack did not become ready:\n" + stack.log_path.read_text()[-4000:])


# The stacks started and not yet stopped (at most one: see start_stack).
_LIVE: list[Stack] = []


def start_stack(redis_url: str, **env_vars: str) -> Stack:
    """``charserve up`` on a free port with ``env_vars`` set, ready to serve; any stack
    still running is stopped first (one engine at a time on this machine)."""
    while _LIVE:
        _LIVE.pop().stop()
    port = free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="charserve-e2e-"))
    log_path = log_dir / "up.log"
    env = {
        **os.environ,
        "CHARSERVE_PORT": str(port),
        "CHARSERVE_REDIS_URL": redis_url,
        # Its own data folder: one stack holds a folder, and an operator's `make run` on
        # this machine holds the default one.
        "CHARSERVE_DATA_DIR": str(log_dir),
        "CHARSERVE_LOG_FORMAT": "json",
        **env_vars,
    }
    env.pop("RAY_ADDRESS", None)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.ops.cli", "up"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    s = Stack(f"http://127.0.0.1:{port}", redis_url, proc, log_path)
    _LIVE.append(s)
    try:
        _wait_ready(s)
    except BaseException:
        s.stop()
        raise
    return s


@pytest.fixture(scope="session")
def stack(redis_url: str) -> Iterator[Stack]:
    """``charserve up`` on a free port, ready to serve."""
    s = start_stack(redis_url)
    try:
        yield s
    finally:
        s.stop()
