"""The gateway's listening socket: every waiting connection accepted in one turn of the loop.

libuv (uvloop's core) accepts one connection each time the listening socket polls readable,
since libuv 1.45 (its "don't accept() connections in a loop"); the next waits for the next
turn of the event loop. In the gateway a turn also runs the intake of every request that
arrived in the last one (validation, the prompt, admission, the enqueue): about a
millisecond each. So 32 clients that connected at once were accepted one per request's
intake, over 30 to 60 ms on an idle machine and two or three times that while the engine
computes, and the engine started the first of them alone and the rest a step or two later
(docs/benchmarks.md, session 35). Kept-alive connections never had this: their requests
arrive together in one turn.

:class:`BurstAcceptServer` accepts up to :data:`MAX_ACCEPTS_PER_TURN` waiting connections
each time its socket is readable, as asyncio's own selector loop does, and hands each to
the loop as an accepted socket, so a burst of new connections is read, parsed and queued
together. :class:`GatewayLoop` is uvloop's loop with ``create_server`` serving that way for
a host and port; TLS and sockets shared between worker processes
(``CHARSERVE_GATEWAY_WORKERS`` above 1: greedy accepting would pile a burst onto one
process) keep uvloop's own server. ``charserve gateway`` runs uvicorn on it
(``loop="gateway.http.accept:new_event_loop"``).
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Callable, Iterable
from typing import Any

import structlog
import uvloop

log = structlog.get_logger(__name__)

# Bounds one turn's accepting, so that a flood of connections cannot hold the loop: the
# rest wait for the next turn, as libuv's would.
MAX_ACCEPTS_PER_TURN = 128
# Out of descriptors or memory: accepting pauses this long, as asyncio's loop does.
ACCEPT_RETRY_S = 1.0
_RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

LOOP_FACTORY = "gateway.http.accept:new_event_loop"


def bind(host: str | None, port: int, backlog: int) -> list[socket.socket]:
    """Listening, non-blocking sockets for every address ``host`` resolves to (all
    interfaces for None or ""), each made by :func:`socket.create_server` (with
    ``SO_REUSEADDR``, and ``IPV6_V6ONLY`` on IPv6, as asyncio's ``create_server``); a
    taken port is an ``OSError`` naming the address."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, address in dict.fromkeys((info[0], info[4]) for info in infos):
            sock = socket.create_server(address, family=family, backlog=backlog)
            sockets.append(sock)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class BurstAcceptServer(asyncio.AbstractServer):
    """Serves ``protocol_factory`` on listening ``sockets``, accepting every waiting
    connection (up to :data:`MAX_ACCEPTS_PER_TURN`) each time one is readable."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        protocol_factory: Callable[[], asyncio.BaseProtocol],
        sockets: Iterable[socket.socket],
    ) -> None:
        self._loop = loop
        self._protocol_factory = protocol_factory
        self._sockets = list(sockets)
        self._serving = False
        self._adopting: set[asyncio.Task[None]] = set()
        self._retry: asyncio.TimerHandle | None = None
        self._closed = asyncio.Event()

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        """The listening sockets (empty once closed)."""
        return tuple(self._sockets)

    def get_loop(self) -> asyncio.AbstractEventLoop:
        """The loop the server accepts on."""
        return self._loop

    def is_serving(self) -> bool:
        """Whether the server accepts connections."""
        return self._serving

    async def start_serving(self) -> None:
        """Start accepting (idempotent)."""
        if self._serving or not self._sockets:
            return
        self._serving = True
        self._watch()

    async def serve_forever(self) -> None:
        """Accept until closed."""
        await self.start_serving()
        await self._closed.wait()

    def close(self) -> None:
        """Stop accepting and close the listening sockets; connections already accepted
        stay open (uvicorn closes them on shutdown)."""
        self._pause()
        self._serving = False
        for sock in self._sockets:
            sock.close()
        self._sockets = []
        self._closed.set()

    async def wait_closed(self) -> None:
        """Return once accepted sockets still being handed to the loop are."""
        if self._adopting:
            await asyncio.gather(*self._adopting, return_exceptions=True)

    def _pause(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        for sock in self._sockets:
            self._loop.remove_reader(sock.fileno())

    def _watch(self) -> None:
        for sock in self._sockets:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    def _resume(self) -> None:
        self._retry = None
        if self._serving:
            self._watch()

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(MAX_ACCEPTS_PER_TURN):
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client left before the accept: nothing to serve
            except OSError as exc:
                if exc.errno not in _RESOURCE_ERRORS:
                    raise
                log.warning(
                    "cannot accept connections; pausing",
                    error=str(exc),
                    retry_s=ACCEPT_RETRY_S,
                )
                self._pause()
                self._retry = self._loop.call_later(ACCEPT_RETRY_S, self._resume)
                return
            conn.setblocking(False)
            task = self._loop.create_task(self._adopt(conn))
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)

    async def _adopt(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._protocol_factory, conn)
        except Exception as exc:  # one connection's failure is its own
            log.warning("dropped a connection it could not set up", error=str(exc))
            conn.close()


class GatewayLoop(uvloop.Loop):  # type: ignore[misc]
    """uvloop's event loop, whose ``create_server`` for a host and port accepts bursts
    (:class:`BurstAcceptServer`)."""

    async def create_server(  # type: ignore[override]
        self,
        protocol_factory: Callable[[], asyncio.BaseProtocol],
        host: str | None = None,
        port: int | None = None,
        *,
        backlog: int = 100,
        ssl: Any = None,
        sock: socket.socket | None = None,
        **kwargs: Any,
    ) -> asyncio.AbstractServer:
        """A :class:`BurstAcceptServer` on ``host`` and ``port``; uvloop's own server for
        TLS, a given socket or any other option."""
        if ssl is not None or sock is not None or port is None or kwargs:
            uvloop_server: Any = super()  # its overloads do not take the optional forms
            return await uvloop_server.create_server(
                protocol_factory, host, port, backlog=backlog, ssl=ssl, sock=sock, **kwargs
            )
        server = BurstAcceptServer(self, protocol_factory, bind(host, port, backlog))
        await server.start_serving()
        return server


def new_event_loop() -> GatewayLoop:
    """The gateway's event loop (uvicorn's ``loop`` names this factory)."""
    return GatewayLoop()
