"""Redis connections for every charserve process.

Clients use redis-py's asyncio API with the hiredis parser (picked up automatically when
installed). One URL configures a connection completely, since that is what
``CHARSERVE_REDIS_URL`` and the Ray workers' arguments carry:

* ``redis://:PASSWORD@host:6379/0`` - ``requirepass``;
* ``redis://USER:PASSWORD@host:6379/0`` - an ACL user (percent-encode special characters);
* ``rediss://host:6380/0?ssl_ca_certs=/etc/charserve/ca.pem`` - TLS, verifying the server
  against that CA (also ``ssl_certfile`` / ``ssl_keyfile`` for a client certificate,
  ``ssl_cert_reqs=none`` to skip verification, ``ssl_check_hostname=false``).
"""

from __future__ import annotations

import inspect
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis.asyncio as aioredis


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
