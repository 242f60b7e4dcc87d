"""Loopback helpers for the servers the embedded stack, benchmarks and tests start: a free
TCP port, and waiting until a server answers."""

from __future__ import annotations

import random
import socket
import subprocess
import time
import urllib.error
import urllib.request

# Ray's worker processes listen on 10002-19999 by default; ports from here up to the
# kernel's ephemeral range are nobody's by default.
FIXED_PORTS_FROM = 20000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        with open(_EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1", tries: int = 50) -> int:
    """A TCP port that was free a moment ago on ``host``, below the kernel's ephemeral
    range: a port the kernel hands out (bind to port 0) is also what every outgoing
    connection and every other bind-to-0 server takes meanwhile (Ray starts dozens), and
    one of them took a test gateway's port between this pick and the gateway's bind."""
    top = _ephemeral_low()
    if top > FIXED_PORTS_FROM:
        for _ in range(tries):
            port = random.randrange(FIXED_PORTS_FROM, top)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """Poll ``url`` until it answers 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f}s")
