"""Loopback helpers for the servers the embedded stack, benchmarks and tests start: a free
TCP port, and waiting until a server answers."""

from __future__ import annotations

import contextlib
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


def _bind_below(sock: socket.socket, host: str, top: int, tries: int) -> int:
    """Bind ``sock`` to a random port from FIXED_PORTS_FROM up to ``top`` (the kernel's
    pick when none binds, or there is no room); the port it holds."""
    for _ in range(tries if top > FIXED_PORTS_FROM else 0):
        try:
            sock.bind((host, random.randrange(FIXED_PORTS_FROM, top)))
            break
        except OSError:
            continue  # a failed bind leaves the socket unbound: try another port
    else:
        sock.bind((host, 0))
    return int(sock.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1", tries: int = 50) -> list[int]:
    """``n`` distinct TCP ports that were free a moment ago on ``host`` (held together
    while picked), below the kernel's ephemeral range: a port the kernel hands out (bind
    to port 0) is also what every outgoing connection and every other bind-to-0 server
    takes meanwhile (Ray starts dozens), and one of them took a test gateway's port
    between the pick and the gateway's bind."""
    top = _ephemeral_low()
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(n)]
        return [_bind_below(sock, host, top, tries) for sock in socks]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (see :func:`free_ports`)."""
    return free_ports(1, host)[0]


def check_port_free(host: str, port: int) -> None:
    """Raise ``OSError`` naming ``host:port`` unless a server could bind it now (with
    ``SO_REUSEADDR``, as uvicorn binds: a port left in TIME_WAIT counts as free)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise OSError(exc.errno, f"{host}:{port} is in use ({exc.strerror})") from None


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
