"""Redis connections, and a local ``redis-server`` for the embedded stack and the tests.

Clients use redis-py's asyncio API with the hiredis parser (picked up automatically when
installed). :class:`RedisServer` runs Debian's ``redis-server`` bound to 127.0.0.1 and
stops it on close: with persistence off in a temporary folder (tests), or with an
append-only file in a data folder that outlives it (``charserve up``), so keys,
characters, sessions and batches survive a restart.

One URL configures a connection completely, since that is what ``CHARSERVE_REDIS_URL``
and the Ray workers' arguments carry:

* ``redis://:PASSWORD@host:6379/0`` - ``requirepass``;
* ``redis://USER:PASSWORD@host:6379/0`` - an ACL user (percent-encode special characters);
* ``rediss://host:6380/0?ssl_ca_certs=/etc/charserve/ca.pem`` - TLS, verifying the server
  against that CA (also ``ssl_certfile`` / ``ssl_keyfile`` for a client certificate,
  ``ssl_cert_reqs=none`` to skip verification, ``ssl_check_hostname=false``).
"""

from __future__ import annotations

import inspect
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
import structlog

log = structlog.get_logger(__name__)


def connect(url: str, *, blocking: bool = False, max_connections: int = 512) -> aioredis.Redis:
    """An asyncio client. ``blocking=True`` is for connections that ``BLPOP``: no health
    check pings, so a long block is not mistaken for a dead server.

    The URL carries credentials and TLS options (see the module docstring); options in its
    query string override the defaults here. Pub/sub and blocking clients come from here
    too, so they authenticate and encrypt the same way.

    The pool waits (up to 5 s) for a free connection when all ``max_connections`` are busy:
    redis-py's default pool raises "Too many connections" past 100, which under a burst of
    requests would turn into errors instead of a short wait.
    """
    check_url(url)
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


def _init_params(*classes: type) -> frozenset[str]:
    """Keyword parameters the ``__init__`` of ``classes`` accept."""
    return frozenset(
        name
        for cls in classes
        for name, param in inspect.signature(cls).parameters.items()
        if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
    )


_CONNECTION_PARAMS = _init_params(
    aioredis.connection.AbstractConnection, aioredis.connection.Connection
) | {"max_connections", "timeout"}
_TLS_PARAMS = _init_params(aioredis.connection.SSLConnection)

# How long an embedded server may spend loading its append-only file before start gives up.
LOAD_TIMEOUT_S = 600.0


def check_url(url: str) -> None:
    """Reject a Redis URL whose query string redis-py would only choke on at the first
    command (an unknown option, or a TLS option without ``rediss://``), with a message
    that says why. Raises :class:`ValueError`."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            f"Redis URL must start with redis://, rediss:// or unix://: {redacted_url(url)}"
        )
    for name in parse_qs(parts.query):
        if name in _TLS_PARAMS and parts.scheme != "rediss":
            raise ValueError(
                f"Redis URL option {name!r} needs TLS: use rediss:// ({redacted_url(url)})"
            )
        if name not in _CONNECTION_PARAMS | _TLS_PARAMS:
            raise ValueError(f"unknown Redis URL option {name!r} ({redacted_url(url)})")


def redacted_url(url: str) -> str:
    """``url`` with its password replaced by ``***``, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


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
    ) -> None:
        self.port = port or free_port()
        self.data_dir = Path(data_dir).expanduser() if data_dir else None
        self.password = password
        self.acl_user = acl_user
        self.tls = tls
        self._proc: subprocess.Popen[bytes] | None = None
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
        # "-" reads config from stdin first; the command line below overrides it, so the
        # TLS lines' "port 0" must not be contradicted there.
        port = [] if self.tls is not None else ["--port", str(self.port)]
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
                "--protected-mode",
                "yes",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
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
                    raise RuntimeError(f"redis-server exited with {self._proc.returncode}")
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
