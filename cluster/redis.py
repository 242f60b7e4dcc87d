"""Redis connections, and a local ``redis-server`` for the embedded stack and the tests.

Clients use redis-py's asyncio API with the hiredis parser (picked up automatically when
installed). :class:`RedisServer` runs Debian's ``redis-server`` bound to 127.0.0.1 and
stops it on close: with persistence off in a temporary folder (tests), or with an
append-only file in a data folder that outlives it (``charserve up``), so keys,
characters, sessions and batches survive a restart.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis
import redis.asyncio as aioredis
import structlog

log = structlog.get_logger(__name__)


def connect(url: str, *, blocking: bool = False, max_connections: int = 512) -> aioredis.Redis:
    """An asyncio client. ``blocking=True`` is for connections that ``BLPOP``: no health
    check pings, so a long block is not mistaken for a dead server.

    The pool waits (up to 5 s) for a free connection when all ``max_connections`` are busy:
    redis-py's default pool raises "Too many connections" past 100, which under a burst of
    requests would turn into errors instead of a short wait.
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=5,
        decode_responses=False,
        health_check_interval=0 if blocking else 30,
        socket_connect_timeout=5,
        socket_keepalive=True,
    )
    return aioredis.Redis.from_pool(pool)  # the client owns (and closes) the pool


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def find_redis_server() -> str:
    """Path of the ``redis-server`` binary (on PATH or Debian's /usr/bin, /usr/sbin)."""
    found = shutil.which("redis-server")
    for candidate in (found, "/usr/bin/redis-server", "/usr/sbin/redis-server"):
        if candidate and Path(candidate).is_file():
            return candidate
    raise FileNotFoundError(
        "redis-server not found: install Debian's redis-server (make install does) "
        "or set CHARSERVE_REDIS_URL to an existing Redis"
    )


class RedisServer:
    """A private ``redis-server`` on 127.0.0.1, started by :meth:`start` and stopped by
    :meth:`stop` (also as a context manager)."""

    def __init__(self, port: int | None = None, data_dir: str | Path | None = None) -> None:
        self.port = port or free_port()
        self.data_dir = Path(data_dir).expanduser() if data_dir else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        if self.data_dir is None:
            if self._dir is None:
                self._dir = tempfile.TemporaryDirectory(prefix="charserve-redis-")
            folder, persistence = self._dir.name, ["--appendonly", "no"]
        else:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            folder = str(self.data_dir)
            persistence = ["--appendonly", "yes", "--appendfsync", "everysec"]
        self._proc = subprocess.Popen(
            [
                find_redis_server(),
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                *persistence,
                "--dir",
                folder,
                "--protected-mode",
                "yes",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self._proc.returncode}")
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise TimeoutError("redis-server did not start") from None
                    time.sleep(0.02)
        finally:
            client.close()
        log.info("redis-server started", url=self.url, pid=self._proc.pid)
        return self

    def stop_process(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) but keep its folder: :meth:`start`
        brings it back on the same port (with its data, when it has a data folder)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def stop(self) -> None:
        """Stop the server and remove its temporary folder."""
        self.stop_process()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
