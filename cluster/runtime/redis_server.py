"""A local ``redis-server`` for the embedded stack and the tests.

:class:`RedisServer` runs Debian's ``redis-server`` bound to 127.0.0.1 and stops it on
close: with persistence off in a temporary folder (tests), or with an append-only file in a
data folder that outlives it (``charserve up``), so keys, characters, sessions and batches
survive a restart. Its :attr:`RedisServer.url` carries what a client needs (see
:mod:`cluster.runtime.redis_client` for the URL forms).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import redis
import structlog

from cluster.runtime.net import free_port
from cluster.runtime.redis_client import redacted_url

log = structlog.get_logger(__name__)

# How long an embedded server may spend loading its append-only file before start gives up.
LOAD_TIMEOUT_S = 600.0
# The server's log, in its folder; a failed start quotes the last warning in it.
LOG_NAME = "redis.log"
LOG_TAIL_BYTES = 8192


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS ``redis-server``: the CA that signed ``cert`` (clients verify the
    server against it) and the server's certificate and private key."""

    ca_cert: Path
    cert: Path
    key: Path


def _config_arg(value: str) -> str:
    """``value`` quoted for a redis.conf line (kept off the command line, where ``ps``
    would show secrets)."""
    if any(ord(c) < 0x20 or c == "\x7f" for c in value):
        raise ValueError("Redis passwords and user names cannot hold control characters")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


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
    :meth:`stop` (also as a context manager).

    Optionally it requires ``password`` (``requirepass``), an ACL user ``acl_user`` (name,
    password; with no ``password`` the default user is then disabled), or TLS on its
    port (``tls``; clients need no certificate). :attr:`url` carries what a client needs.
    """

    def __init__(
        self,
        port: int | None = None,
        data_dir: str | Path | None = None,
        *,
        password: str | None = None,
        acl_user: tuple[str, str] | None = None,
        tls: TlsFiles | None = None,
        maxmemory_bytes: int = 0,
        hold_fds: tuple[int, ...] = (),
    ) -> None:
        self.port = port or free_port()
        # 0: no bound. Otherwise the server refuses writes past it (noeviction: charserve
        # never lets Redis drop a job, a lease or a log to make room).
        self.maxmemory_bytes = maxmemory_bytes
        # Absolute: Redis enters --dir before it opens its log file.
        self.data_dir = Path(data_dir).expanduser().resolve() if data_dir else None
        # Open files the server keeps open while it runs: a lock on its data folder (see
        # cluster.ops.stack) is then held as long as the server writes there, even when
        # the process that started it was killed.
        self.hold_fds = hold_fds
        self.password = password
        self.acl_user = acl_user
        self.tls = tls
        self._proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self._log_from = 0
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``, with the ACL user's or the ``requirepass``
        credentials, and as ``rediss://...?ssl_ca_certs=CA`` under TLS."""
        if self.acl_user is not None:
            user, password = self.acl_user
            auth = f"{quote(user, safe='')}:{quote(password, safe='')}@"
        elif self.password is not None:
            auth = f":{quote(self.password, safe='')}@"
        else:
            auth = ""
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        ca = quote(str(self.tls.ca_cert), safe="/")
        return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={ca}"

    def _security_config(self) -> str:
        """redis.conf lines for the password, ACL user and TLS (fed on stdin)."""
        lines: list[str] = []
        if self.password is not None:
            lines.append(f"requirepass {_config_arg(self.password)}")
        if self.acl_user is not None:
            user, password = self.acl_user
            lines.append(f"user {_config_arg(user)} on {_config_arg('>' + password)} ~* &* +@all")
            if self.password is None:
                lines.append("user default off")
        if self.tls is not None:
            lines += [
                "port 0",
                f"tls-port {self.port}",
                f"tls-cert-file {_config_arg(str(self.tls.cert))}",
                f"tls-key-file {_config_arg(str(self.tls.key))}",
                f"tls-ca-cert-file {_config_arg(str(self.tls.ca_cert))}",
                "tls-auth-clients no",
            ]
        return "".join(line + "\n" for line in lines)

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
        self.log_path = Path(folder) / LOG_NAME
        # A failed start quotes only what this run logged, not an earlier run's last words.
        self._log_from = self.log_path.stat().st_size if self.log_path.is_file() else 0
        # "-" reads config from stdin first; the command line below overrides it, so the
        # TLS lines' "port 0" must not be contradicted there.
        port = [] if self.tls is not None else ["--port", str(self.port)]
        with self.log_path.open("ab") as log_file:
            self._proc = subprocess.Popen(
                [
                    find_redis_server(),
                    "-",
                    "--bind",
                    "127.0.0.1",
                    *port,
                    "--save",
                    "",
                    *persistence,
                    "--dir",
                    folder,
                    # Its own log (not a pipe nobody reads): a failed start quotes it.
                    "--logfile",
                    str(self.log_path),
                    "--protected-mode",
                    "yes",
                    "--maxmemory",
                    str(self.maxmemory_bytes),
                    "--maxmemory-policy",
                    "noeviction",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                # Errors before its log is open (a bad config line) go there too.
                stderr=log_file,
                pass_fds=self.hold_fds,
                # Its own session: a Ctrl-C in the terminal (SIGINT to the foreground group)
                # reaches only its owner, which stops it last, after everything that uses it.
                start_new_session=True,
            )
        assert self._proc.stdin is not None
        with self._proc.stdin:
            self._proc.stdin.write(self._security_config().encode())
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop_process()  # never leave a server behind that nobody will stop
            raise
        log.info("redis-server started", url=redacted_url(self.url), pid=self._proc.pid)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        """Wait until the server answers PING. While it loads its data (a large append-only
        file after heavy use takes minutes) it answers LOADING: that is progress, so only
        :data:`LOAD_TIMEOUT_S` bounds it; ``timeout_s`` bounds everything else."""
        assert self._proc is not None
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.2)
        started = time.monotonic()
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(self._exit_message(self._proc.returncode))
                try:
                    client.ping()
                    return
                except redis.BusyLoadingError:
                    if time.monotonic() - started > LOAD_TIMEOUT_S:
                        raise TimeoutError("redis-server is still loading its data") from None
                except redis.ConnectionError:
                    if time.monotonic() - started > timeout_s:
                        raise TimeoutError("redis-server did not start") from None
                time.sleep(0.02)
        finally:
            client.close()

    def _exit_message(self, code: int) -> str:
        """Why the server stopped, in its own words: the last warning of its log (a
        corrupt append-only file, a port in use) and where the whole log is."""
        message = f"redis-server exited with {code}"
        if self.log_path is None or not self.log_path.is_file():
            return message
        with self.log_path.open("rb") as log_file:
            size = self.log_path.stat().st_size
            log_file.seek(max(self._log_from, size - LOG_TAIL_BYTES))
            tail = log_file.read().decode(errors="replace").splitlines()
        # Redis marks warnings with "#" after the timestamp (notices "*", verbose "-"); what
        # it says before its log is open (a bad config line) has no mark.
        warnings = [line.split(" # ", 1)[1] for line in tail if " # " in line]
        said = warnings or [line.strip() for line in tail if line.strip()]
        if said:
            message += ": " + said[-1]
        return f"{message} (its log: {self.log_path})"

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

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._proc.pid if self._proc is not None else None

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
