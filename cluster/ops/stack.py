"""The embedded stack behind ``charserve up`` (and ``make run``).

Starts what is missing, in order: the bundled model (prepared once), a private
``redis-server`` unless ``CHARSERVE_REDIS_URL`` names one, a local Ray instance unless
``RAY_ADDRESS`` names a cluster, the Serve application from ``ray-configs/local-cpu.yaml``,
and the gateway processes. :meth:`LocalStack.stop` stops everything it started, in reverse.

A Ctrl-C in a terminal sends SIGINT to the whole foreground process group. Redis and the
gateway run in sessions of their own, and Ray's daemons start ignoring SIGINT (see
:func:`sigint_ignored`), so only ``charserve up`` receives it and stops the stack in
order: the gateway, Serve (its controller still has its Ray), Ray, then Redis. Were Ray's
daemons to die first, Serve's shutdown would wait about 40 s for a controller that is gone.

The Serve config is completed as :mod:`cluster.ops.serve_config` says (the Redis URL, the
model and the settings a gateway and its workers share) and deployed the way ``serve run
CONFIG`` does it (:mod:`cluster.ops.ray_serve`), so the same file also works with ``serve
deploy`` on a running cluster.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import structlog

from cluster.ops import ray_serve
from cluster.ops.serve_config import gateway_env, load_serve_config
from cluster.runtime.bundled_model import resolve_model
from cluster.runtime.net import check_port_free, wait_ready
from cluster.runtime.redis_server import RedisServer
from cluster.runtime.settings import Settings

log = structlog.get_logger(__name__)

# In the data folder, held by the running stack (see data_dir_lock).
LOCK_NAME = "up.lock"


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """Processes started inside ignore SIGINT (the disposition survives exec; Python
    leaves an ignored SIGINT ignored), so a terminal's Ctrl-C does not kill them before
    their owner has stopped what depends on them. Main thread only; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def url_file(settings: Settings) -> Path:
    """Where a running ``charserve up`` writes the URL of its embedded Redis."""
    return Path(settings.data_dir).expanduser() / "redis.url"


def admin_redis_url(settings: Settings) -> str:
    """The Redis an admin command should use: ``CHARSERVE_REDIS_URL``, else the embedded
    stack's (while ``charserve up`` runs)."""
    if settings.redis_url:
        return settings.redis_url
    path = url_file(settings)
    if path.is_file():
        return path.read_text().strip()
    raise RuntimeError("set CHARSERVE_REDIS_URL (or start `charserve up` on this machine)")


class StackConflict(RuntimeError):
    """What this stack needs is taken: another ``charserve up`` holds its data folder, or
    something listens on its port."""


@contextlib.contextmanager
def data_dir_lock(data_dir: str) -> Iterator[int]:
    """Hold ``data_dir`` for one stack: two embedded Redis servers writing one append-only
    file corrupt it, and the second stack's gateway cannot bind the first one's port.
    Yields the lock file's descriptor. The lock is the kernel's (``flock``), held while any
    process keeps that file open: the stack hands it to its Redis (which outlives a stack
    killed with SIGKILL, and keeps writing), so the folder is free exactly when neither
    runs. The file keeps the holder's pid for the message."""
    folder = Path(data_dir).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    with path.open("a+") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            holder = lock_file.read().strip() or "unknown"
            raise StackConflict(
                f"another `charserve up` (pid {holder}), or the Redis it started, is using "
                f"{folder}: stop it, or give this one its own CHARSERVE_DATA_DIR and "
                "CHARSERVE_PORT"
            ) from None
        lock_file.truncate(0)
        lock_file.write(f"{os.getpid()}\n")
        lock_file.flush()
        try:
            yield lock_file.fileno()
        finally:
            lock_file.truncate(0)  # closing the file releases this process's hold


class LocalStack:
    """Redis, Ray, the Serve app and the gateway on this machine."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._redis: RedisServer | None = None
        self._ray_started = False
        self._gateway: subprocess.Popen[bytes] | None = None
        self._held = contextlib.ExitStack()
        self.redis_url = settings.redis_url or ""

    @property
    def base_url(self) -> str:
        """The gateway's base URL."""
        return f"http://{self.settings.host}:{self.settings.port}"

    def start(self) -> None:
        """Bring everything up; on failure, stop what was started and re-raise."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        import ray

        # Refuse at once, before starting anything, what would collide with a stack
        # already running here (its data folder, its port).
        lock_fd = self._held.enter_context(data_dir_lock(self.settings.data_dir))
        try:
            check_port_free(self.settings.host, self.settings.port)
        except OSError as exc:
            raise StackConflict(
                f"{exc.strerror}: stop what listens there, or set CHARSERVE_PORT"
            ) from None
        model = resolve_model(self.settings.model)
        redis_url = self.settings.redis_url
        if not redis_url:
            self._redis = RedisServer(
                data_dir=self.settings.data_dir,
                maxmemory_bytes=self.settings.redis_maxmemory_mb * 1024 * 1024,
                hold_fds=(lock_fd,),
            ).start()
            redis_url = self._redis.url
            # `charserve keys` and other admin commands find the embedded Redis here.
            url_file(self.settings).write_text(redis_url + "\n")
        self.redis_url = redis_url
        config = load_serve_config(self.settings.serve_config, self.settings, redis_url)
        address = os.environ.get("RAY_ADDRESS")
        # ray.init installs its own C-level SIGTERM handler (which aborts the driver);
        # put ours back afterwards so SIGTERM stops the stack in order.
        handler = signal.getsignal(signal.SIGTERM)
        if address:
            ray.init(address=address, logging_level=logging.WARNING)
        else:
            # Lean local Ray: no dashboard, nothing listening beyond 127.0.0.1.
            with sigint_ignored():
                ray.init(
                    include_dashboard=False,
                    dashboard_host="127.0.0.1",
                    logging_level=logging.WARNING,
                    _node_ip_address="127.0.0.1",
                )
        self._ray_started = True
        if callable(handler) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, handler)
        ray_serve.deploy(config)
        env = {
            **os.environ,
            **gateway_env(config),
            "CHARSERVE_REDIS_URL": redis_url,
            "CHARSERVE_MODEL": self.settings.model or model,
        }
        self._gateway = subprocess.Popen(
            [sys.executable, "-m", "cluster.ops.cli", "gateway"],
            env=env,
            start_new_session=True,  # stopped by stop(), before what it needs
        )
        wait_ready(f"{self.base_url}/ready", self._gateway, timeout_s=300)

    def wait(self) -> int:
        """Block until the gateway exits; return its exit code."""
        assert self._gateway is not None
        return self._gateway.wait()

    def stop(self) -> None:
        """Stop everything this stack started, newest first, then let go of the data
        folder (whatever failed on the way)."""
        try:
            self._stop()
        finally:
            self._held.close()

    def _stop(self) -> None:
        if self._gateway is not None:
            if self._gateway.poll() is None:
                self._gateway.terminate()
                try:
                    self._gateway.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self._gateway.kill()
                    self._gateway.wait()
            self._gateway = None
        if self._ray_started:
            import ray
            from ray import serve

            try:
                serve.shutdown()
            except Exception as exc:  # Ray may already be gone
                log.warning("serve shutdown failed", error=str(exc))
            ray.shutdown()
            self._ray_started = False
        if self._redis is not None:
            self._redis.stop()
            self._redis = None
            url_file(self.settings).unlink(missing_ok=True)
