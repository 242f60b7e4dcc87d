"""Redis connections for every charserve process.

Clients use redis-py's asyncio API with the hiredis parser (picked up automatically when
installed). One URL configures a connection completely, since that is what
``CHARSERVE_REDIS_URL`` and the Ray workers' arguments carry:

* ``redis://:PASSWORD@host:6379/0`` - ``requirepass``;
* ``redis://USER:PASSWORD@host:6379/0`` - an ACL user (percent-encode special characters);
* ``rediss://host:6380/0?ssl_ca_certs=/etc/charserve/ca.pem`` - TLS, verifying the server
  against that CA (also ``ssl_certfile`` / ``ssl_keyfile`` for a client certificate,
  ``ssl_cert_reqs=none`` to skip verification, ``ssl_check_hostname=false``);
* ``redis+cluster://[USER:PASSWORD@]host:7000[,host2:7000...][/0]`` - a Redis Cluster
  (``rediss+cluster://`` with TLS). The hosts are seeds: the client learns the other nodes
  and the slot map from them and follows ``MOVED``/``ASK`` and failovers. The database is
  always 0;
* ``redis+sentinel://[USER:PASSWORD@]sentinel1:26379[,sentinel2:26379...]/MASTER[/DB]``
  - a primary that Redis Sentinel fails over (``rediss+sentinel://`` with TLS, to the
  sentinels and the data nodes alike). The hosts are sentinels (port 26379 unless given);
  ``MASTER`` is the name they monitor it under; ``USER:PASSWORD`` authenticate to the
  primary. Sentinels that require a password of their own take the options
  ``sentinel_username`` and ``sentinel_password``. Each new connection asks the
  sentinels where the primary is, so a failover is followed.

The same query-string options work on every form (a cluster takes no ``db`` other than 0
and no pool ``timeout``: redis-py's cluster client does not wait for a free connection).
Every key of a deployment carries its namespace as a hash tag (:mod:`cluster.wire.keys`),
so on a cluster one deployment lives in one slot: its Lua scripts, ``MULTI`` pipelines
and multi-key ``BLPOP`` never meet CROSSSLOT.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Literal, cast
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.asyncio.sentinel as aiosentinel
import redis.cluster
import redis.sentinel
from redis.asyncio.connection import parse_url as _redis_parse_url
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

Topology = Literal["single", "cluster", "sentinel"]

# scheme -> (topology, TLS)
_SCHEMES: dict[str, tuple[Topology, bool]] = {
    "redis": ("single", False),
    "rediss": ("single", True),
    "unix": ("single", False),
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
}
_DEFAULT_PORT: dict[Topology, int] = {"single": 6379, "cluster": 6379, "sentinel": 26379}
# Options of a sentinel URL that are for the sentinels, not for the data nodes.
_SENTINEL_OPTIONS = {"sentinel_username": "username", "sentinel_password": "password"}
# Query-string options that hold secrets (redacted in logs).
_SECRET_OPTIONS = frozenset({"password", "sentinel_password"})

# A cluster client tries a command once more when a node is unreachable or the cluster
# is reconfiguring, after re-reading the slot map, so a replica's promotion that already
# happened costs no error. Only once: a node that does not answer at all costs a connect
# timeout per try, and charserve's own retries (503 + Retry-After, workers' claim loop)
# handle an outage; a re-sent script whose reply was lost could also run twice.
CLUSTER_RETRIES = 1
CLUSTER_BACKOFF = (0.05, 0.5)  # base, cap (s): the one retry waits up to 0.1 s
# A sentinel answers from memory: if one does not within this, ask the next.
SENTINEL_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class RedisTarget:
    """What a Redis URL names: a server (``single``), a Redis Cluster's seed nodes, or
    the sentinels of a primary (``service_name``), and the keyword arguments (credentials,
    database, TLS and socket options) for every connection to a data node."""

    topology: Topology
    tls: bool
    nodes: tuple[tuple[str, int], ...] = ()
    service_name: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    sentinel_options: dict[str, Any] = field(default_factory=dict)


def connect(url: str, *, blocking: bool = False, max_connections: int = 512) -> aioredis.Redis:
    """An asyncio client. ``blocking=True`` is for connections that ``BLPOP``: no health
    check pings, so a long block is not mistaken for a dead server.

    The URL carries credentials and TLS options (see the module docstring); options in its
    query string override the defaults here. Pub/sub and blocking clients come from here
    too, so they authenticate and encrypt the same way.

    The pool waits (up to 5 s) for a free connection when all ``max_connections`` are busy:
    redis-py's default pool raises "Too many connections" past 100, which under a burst of
    requests would turn into errors instead of a short wait. (A cluster client has a pool
    of ``max_connections`` per node and does not wait.)

    For a ``+cluster`` URL the client is redis-py's :class:`~redis.asyncio.cluster.RedisCluster`,
    typed as :class:`~redis.asyncio.Redis`: it has the commands, scripts, pipelines
    (``MULTI`` within one slot) and pub/sub charserve uses, with the same signatures
    (``tests/cluster/test_redis_ha.py`` runs the queue through it).
    """
    target = parse_url(url)
    defaults: dict[str, Any] = {
        "decode_responses": False,
        "health_check_interval": 0 if blocking else 30,
        "socket_connect_timeout": 5,
        "socket_keepalive": True,
    }
    if target.topology == "cluster":
        cluster = _RedisCluster(
            startup_nodes=[aiocluster.ClusterNode(host, port) for host, port in target.nodes],
            **{
                "max_connections": max_connections,
                # As on one server: no read timeout, so a BLPOP or XREAD BLOCK may wait.
                "socket_timeout": None,
                "retry": AsyncRetry(
                    ExponentialWithJitterBackoff(*CLUSTER_BACKOFF), CLUSTER_RETRIES
                ),
                **defaults,
                **_cluster_options(target),
            },
        )
        # RedisCluster is not a subclass of Redis, but serves every call charserve makes.
        return cast(aioredis.Redis, cluster)
    if target.topology == "sentinel":
        sentinel = aiosentinel.Sentinel(
            list(target.nodes),
            sentinel_kwargs=_sentinel_kwargs(target),
            **{**defaults, **_node_options(target)},
        )
        client = sentinel.master_for(
            target.service_name,
            redis_class=_SentinelRedis,
            connection_pool_class=_BlockingSentinelPool,
            max_connections=max_connections,
            timeout=5,
        )
        client.sentinel_manager = sentinel
        return cast(aioredis.Redis, client)
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=5,
        **defaults,
    )
    return aioredis.Redis.from_pool(pool)  # the client owns (and closes) the pool


def connect_sync(
    url: str, *, socket_timeout: float | None = 5.0, health_check_interval: int = 30
) -> redis.Redis:
    """A synchronous client for the same URL forms as :func:`connect` (for threads that
    poll Redis, such as the autoscaling policy's backlog watch). Close it with
    ``close()``; a sentinel client closes its sentinel connections with it."""
    target = parse_url(url)
    defaults: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": 5,
        "health_check_interval": health_check_interval,
    }
    if target.topology == "cluster":
        cluster = redis.cluster.RedisCluster(
            startup_nodes=[redis.cluster.ClusterNode(host, port) for host, port in target.nodes],
            **{
                "retry": Retry(ExponentialWithJitterBackoff(*CLUSTER_BACKOFF), CLUSTER_RETRIES),
                **defaults,
                **_cluster_options(target),
            },
        )
        return cast(redis.Redis, cluster)
    if target.topology == "sentinel":
        sentinel = redis.sentinel.Sentinel(
            list(target.nodes),
            sentinel_kwargs=_sentinel_kwargs(target),
            **{**defaults, **_node_options(target)},
        )
        client = sentinel.master_for(target.service_name, redis_class=_SyncSentinelRedis)
        client.sentinel_manager = sentinel
        return cast(redis.Redis, client)
    return redis.Redis.from_url(url, **defaults)


class _RedisCluster(aiocluster.RedisCluster):
    """redis-py's cluster client, with a pub/sub that survives a failover and pipelines
    that may read the clock."""

    async def initialize(self, *args: Any, **kwargs: Any) -> aiocluster.RedisCluster:
        """Load the slot map (when due). No node answering is a
        :class:`redis.ConnectionError`, as one server down is, so that callers' handling of
        an unreachable Redis (503, retries) covers it: redis-py raises a
        ``RedisClusterException``, which is not a ``RedisError``."""
        try:
            return await super().initialize(*args, **kwargs)
        except redis.RedisClusterException as exc:
            raise redis.ConnectionError(f"Redis Cluster unreachable: {exc}") from exc

    def pipeline(
        self, transaction: Any | None = None, shard_hint: Any | None = None
    ) -> aiocluster.ClusterPipeline:
        """A :class:`_ClusterPipeline` (same arguments as redis-py's)."""
        if shard_hint:
            raise redis.RedisClusterException("shard_hint is deprecated in cluster mode")
        # redis-py's stubs leave an attribute abstract that its __init__ sets.
        return _ClusterPipeline(self, transaction)  # type: ignore[abstract]

    def pubsub(
        self,
        node: aiocluster.ClusterNode | None = None,
        host: str | None = None,
        port: int | None = None,
        **kwargs: Any,
    ) -> aiocluster.ClusterPubSub:
        """A :class:`_ClusterPubSub` (same arguments as redis-py's)."""
        return _ClusterPubSub(self, node=node, host=host, port=port, **kwargs)


class _ClusterPipeline(aiocluster.ClusterPipeline):
    """redis-py's cluster pipeline, which refuses ``TIME`` (keyless commands are blocked
    in cluster pipelines) and ``EVALSHA``. charserve's heartbeat and capacity reads
    pipeline ``TIME`` with their keyed reads to follow Redis's clock: it goes to the
    client's default node, in parallel with the keyed commands' node (a cluster's clocks
    must agree, as the scripts' lease times come from the node of the namespace's slot)."""

    def time(self, **kwargs: Any) -> Any:
        """Queue ``TIME``."""
        return self.execute_command("TIME", **kwargs)

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:
        """Queue ``EVALSHA``, which redis-py blocks in cluster pipelines: the cluster
        client finds its slot from its keys, as for a call outside a pipeline (a clump of
        enqueues is pipelined; every key of a namespace shares one slot)."""
        return self.execute_command("EVALSHA", sha, numkeys, *keys_and_args)


class _ClusterPubSub(aiocluster.ClusterPubSub):
    """redis-py's cluster pub/sub (redis-py 8.1) with two gaps closed.

    * Its first ``SUBSCRIBE`` picks a node from the slot map, which a client that has run
      no command yet does not have (``KeyError``): load the map first.
    * It pins its connection to that node for good, so once the node dies its reconnects
      keep failing even after a replica took over. Classic pub/sub is broadcast to every
      node of a cluster, so any live node will do: after a connection error the
      connection is dropped, and the next read subscribes again through the node the
      refreshed slot map names (the caller sees the one error, as with one server).
    """

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        """As redis-py's, once the cluster client knows its nodes."""
        await self.cluster.initialize()
        return await super().execute_command(*args, **kwargs)

    async def parse_response(self, block: bool = True, timeout: float = 0) -> Any:  # noqa: ASYNC109 - redis-py's signature
        """As redis-py's; on a connection error, unpin from the node first."""
        try:
            if self.connection is None and self.subscribed:
                try:
                    await self.cluster.nodes_manager.initialize()  # where the slots are now
                except redis.RedisClusterException as exc:
                    raise redis.ConnectionError(f"Redis Cluster unreachable: {exc}") from exc
                await self._resubscribe(self.channels, self.subscribe)
                await self._resubscribe(self.patterns, self.psubscribe)
            return await super().parse_response(block, timeout)
        except (redis.ConnectionError, redis.TimeoutError):
            # (A read that merely times out returns None: these are lost connections.)
            await self._unpin()
            raise

    async def _unpin(self) -> None:
        """Forget the node and its connection; subscriptions are kept to be renewed."""
        connection, self.connection = self.connection, None
        if connection is not None:
            connection.deregister_connect_callback(self.on_connect)
            await connection.disconnect(nowait=True)
            if self.connection_pool is not None:
                await self.connection_pool.release(connection)
        self.connection_pool = None  # type: ignore[assignment]
        self.node = None


class _SentinelRedis(aioredis.Redis):
    """The primary's client; closing it closes its connections to the sentinels too
    (redis-py leaves those to the :class:`~redis.asyncio.sentinel.Sentinel`, which
    nothing else here holds)."""

    sentinel_manager: aiosentinel.Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        """Close the client, its pool and the sentinel connections."""
        try:
            await super().aclose(close_connection_pool)
        finally:
            if self.sentinel_manager is not None:
                await self.sentinel_manager.aclose()


class _SyncSentinelRedis(redis.Redis):
    """:class:`_SentinelRedis` for the synchronous client."""

    sentinel_manager: redis.sentinel.Sentinel | None = None

    def close(self) -> None:
        """Close the client, its pool and the sentinel connections."""
        try:
            super().close()
        finally:
            if self.sentinel_manager is not None:
                self.sentinel_manager.close()


class _BlockingSentinelPool(aiosentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Sentinel's pool (it asks the sentinels for the primary at every new connection and
    drops connections to a primary that was replaced) with the blocking pool's wait for a
    free connection, as :func:`connect` gives a single server."""


def _node_options(target: RedisTarget) -> dict[str, Any]:
    """Connection options for the data nodes (TLS as the ``ssl`` flag redis-py's cluster
    and sentinel clients take)."""
    return {**target.options, **({"ssl": True} if target.tls else {})}


def _cluster_options(target: RedisTarget) -> dict[str, Any]:
    options = _node_options(target)
    options.pop("db", None)  # checked to be 0: a cluster has one database
    return options


def _sentinel_kwargs(target: RedisTarget) -> dict[str, Any]:
    """How to reach the sentinels: short timeouts (they answer from memory, and a dead
    one must not hold up asking the next), the URL's TLS options, their own credentials."""
    tls = {k: v for k, v in target.options.items() if k in _TLS_PARAMS}
    return {
        "socket_timeout": SENTINEL_TIMEOUT_S,
        "socket_connect_timeout": SENTINEL_TIMEOUT_S,
        **({"ssl": True, **tls} if target.tls else {}),
        **target.sentinel_options,
    }


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
# RedisCluster takes no **kwargs: an option it does not name would fail at connect.
_CLUSTER_PARAMS = _init_params(aiocluster.RedisCluster)


def parse_url(url: str) -> RedisTarget:
    """What ``url`` names (see the module docstring), or :class:`ValueError` saying what
    is wrong with it: an unknown scheme or option, a TLS option without TLS, a cluster
    database other than 0, a sentinel URL without its primary's name."""
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise ValueError(
            "Redis URL must start with redis://, rediss://, unix://, redis+cluster://, "
            f"rediss+cluster://, redis+sentinel:// or rediss+sentinel://: {redacted_url(url)}"
        )
    topology, tls = _SCHEMES[parts.scheme]
    query = parse_qsl(parts.query, keep_blank_values=True)
    allowed = _CONNECTION_PARAMS | _TLS_PARAMS
    if topology == "cluster":
        allowed = (allowed & _CLUSTER_PARAMS) | {"db"}
    for name, _ in query:
        if topology == "sentinel" and name in _SENTINEL_OPTIONS:
            continue
        if name in _TLS_PARAMS and not tls:
            secure = {"cluster": "rediss+cluster", "sentinel": "rediss+sentinel"}.get(
                topology, "rediss"
            )
            raise ValueError(
                f"Redis URL option {name!r} needs TLS: use {secure}:// ({redacted_url(url)})"
            )
        if name not in allowed:
            raise ValueError(f"unknown Redis URL option {name!r} ({redacted_url(url)})")
    if topology == "single":
        return RedisTarget("single", tls)

    userinfo, _, hosts = parts.netloc.rpartition("@")
    nodes = tuple(_host_port(h, _DEFAULT_PORT[topology], url) for h in hosts.split(","))
    path = [unquote(p) for p in parts.path.split("/") if p]
    service_name, db = "", "0"
    if topology == "cluster":
        if path not in ([], ["0"]) or dict(query).get("db", "0") != "0":
            raise ValueError(f"a Redis Cluster has only database 0 ({redacted_url(url)})")
    else:
        if not path or len(path) > 2:
            raise ValueError(
                "a sentinel URL is redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]"
                f"/MASTER_NAME[/DB] ({redacted_url(url)})"
            )
        service_name, db = path[0], path[1] if len(path) > 1 else "0"
    # redis-py parses (and types) the options of a one-server URL: give it one.
    sentinel_options = {
        _SENTINEL_OPTIONS[name]: value for name, value in query if name in _SENTINEL_OPTIONS
    }
    node_query = urlencode([(n, v) for n, v in query if n not in _SENTINEL_OPTIONS])
    single = urlunsplit(
        (
            "rediss" if tls else "redis",
            f"{userinfo}@h" if userinfo else "h",
            f"/{db}",
            node_query,
            "",
        )
    )
    try:
        options = dict(_redis_parse_url(single))
    except ValueError as exc:
        raise ValueError(f"{exc} ({redacted_url(url)})") from None
    for name in ("host", "port", "connection_class"):
        options.pop(name, None)
    return RedisTarget(topology, tls, nodes, service_name, options, sentinel_options)


def _host_port(text: str, default_port: int, url: str) -> tuple[str, int]:
    """``host[:port]`` (``[v6]:port`` too) of a multi-host URL."""
    try:
        parts = urlsplit(f"//{text}")
        host, port = parts.hostname, parts.port
    except ValueError:
        host = None
    if not host:
        raise ValueError(f"bad host {text!r} in Redis URL ({redacted_url(url)})")
    return host, port or default_port


def check_url(url: str) -> None:
    """Reject a Redis URL whose query string redis-py would only choke on at the first
    command (an unknown option, or a TLS option without ``rediss``), or a malformed
    cluster or sentinel URL, with a message that says why. Raises :class:`ValueError`."""
    parse_url(url)


def redacted_url(url: str) -> str:
    """``url`` with its passwords (in the user info and in ``password`` or
    ``sentinel_password`` options) replaced by ``***``, for logs and error messages."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable Redis URL>"
    userinfo, at, hosts = parts.netloc.rpartition("@")
    netloc = parts.netloc
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hosts}"
    query = parts.query
    if netloc == parts.netloc and not any(
        name in _SECRET_OPTIONS for name, _ in parse_qsl(query, keep_blank_values=True)
    ):
        return url  # nothing to hide: as given
    if any(name in _SECRET_OPTIONS for name, _ in parse_qsl(query, keep_blank_values=True)):
        query = "&".join(
            f"{name}=***" if unquote(name) in _SECRET_OPTIONS else piece
            for piece in query.split("&")
            for name in (piece.partition("=")[0],)
        )
    return urlunsplit(parts._replace(netloc=netloc, query=query))
