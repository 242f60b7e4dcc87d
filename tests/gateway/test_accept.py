"""The gateway's listening socket: a burst of waiting connections is accepted in one turn
of the event loop (libuv alone accepts one a turn), bounded, and paused on a lack of
descriptors instead of failing."""

from __future__ import annotations

import asyncio
import errno
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
import uvloop

from gateway.http import accept
from gateway.http.accept import BurstAcceptServer, GatewayLoop, bind, new_event_loop

WORK_S = 0.002  # what one request's intake costs the loop, roughly


class Recorder(asyncio.Protocol):
    """Notes each connection's start and its data; the data costs the loop WORK_S."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.events.append("A")
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.events.append("D")
        until = time.perf_counter() + WORK_S
        while time.perf_counter() < until:
            pass
        self.transport.write(b"ok")  # type: ignore[attr-defined]


def connect_and_send(port: int, count: int) -> list[socket.socket]:
    """``count`` blocking clients, connected and with their request sent, before the
    server's loop runs at all."""
    clients = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"hello")
        clients.append(sock)
    return clients


def serve_burst(
    count: int, create: Callable[[asyncio.AbstractEventLoop, Any], Any]
) -> tuple[list[str], list[bytes]]:
    """Start a server with ``create``, put ``count`` connections with data in front of it,
    run the loop until all are answered: the order of connection starts and reads, and
    each client's reply."""
    events: list[str] = []

    async def main() -> list[bytes]:
        loop = asyncio.get_running_loop()
        server = await create(loop, lambda: Recorder(events))
        port = server.sockets[0].getsockname()[1]
        clients = connect_and_send(port, count)  # the loop is blocked meanwhile
        try:
            replies = []
            for sock in clients:
                sock.setblocking(False)
                replies.append(await loop.sock_recv(sock, 16))
            return replies
        finally:
            for sock in clients:
                sock.close()
            server.close()
            await server.wait_closed()

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        replies = runner.run(main())
    return events, replies


def test_a_burst_of_waiting_connections_starts_in_one_turn() -> None:
    events, replies = serve_burst(
        32, lambda loop, factory: loop.create_server(factory, "127.0.0.1", 0)
    )
    assert replies == [b"ok"] * 32
    # Every connection started before the first request's work ran.
    assert events == ["A"] * 32 + ["D"] * 32


def test_uvloops_own_server_accepts_one_connection_a_turn() -> None:
    """Why the module exists: with libuv's accept each later connection waits for the
    earlier ones' work (if a libuv release changes this, the module can go)."""

    async def plain(loop: asyncio.AbstractEventLoop, factory: Any) -> Any:
        assert isinstance(loop, uvloop.Loop)
        return await uvloop.Loop.create_server(loop, factory, "127.0.0.1", 0)

    events, replies = serve_burst(8, plain)
    assert replies == [b"ok"] * 8
    assert events.index("D") < events.index("A", 2)  # a read before the later accepts


def test_one_turn_accepts_at_most_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accept, "MAX_ACCEPTS_PER_TURN", 4)
    events, replies = serve_burst(
        10, lambda loop, factory: loop.create_server(factory, "127.0.0.1", 0)
    )
    assert replies == [b"ok"] * 10  # every connection served, four a turn
    assert events == (["A"] * 4 + ["D"] * 4) * 2 + ["A"] * 2 + ["D"] * 2


class FlakyListener:
    """A listening socket whose first accept fails for want of descriptors."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.failures = 1

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> tuple[socket.socket, Any]:
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self.sock.accept()

    def getsockname(self) -> Any:
        return self.sock.getsockname()

    def close(self) -> None:
        self.sock.close()


def test_out_of_descriptors_pauses_accepting_then_resumes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(accept, "ACCEPT_RETRY_S", 0.2)

    async def create(loop: asyncio.AbstractEventLoop, factory: Any) -> Any:
        [sock] = bind("127.0.0.1", 0, 16)
        server = BurstAcceptServer(loop, factory, [FlakyListener(sock)])  # type: ignore[list-item]
        await server.start_serving()
        return server

    started = time.perf_counter()
    _, replies = serve_burst(3, create)
    assert replies == [b"ok"] * 3  # nothing lost: the waiting connections were kept
    assert time.perf_counter() - started >= 0.2  # served after the pause, not before


def test_a_closed_server_refuses_connections() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
        assert isinstance(server, BurstAcceptServer) and server.is_serving()
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        assert not server.is_serving() and server.sockets == ()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main())


def test_a_taken_port_is_an_error_naming_the_address() -> None:
    [taken] = bind("127.0.0.1", 0, 16)
    port = taken.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"127.0.0.1', {port}"):
            bind("127.0.0.1", port, 16)
    finally:
        taken.close()


def test_a_given_socket_keeps_uvloops_server() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, GatewayLoop)
        [sock] = bind("127.0.0.1", 0, 16)
        server = await loop.create_server(asyncio.Protocol, sock=sock)
        assert not isinstance(server, BurstAcceptServer)
        server.close()

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main())


def test_charserve_gateway_runs_uvicorn_on_this_loop() -> None:
    """``cluster`` names the factory by string (it never imports ``gateway``)."""
    import inspect

    from uvicorn.importer import import_from_string

    from cluster.ops import cli

    assert import_from_string(accept.LOOP_FACTORY) is new_event_loop
    assert f'loop="{accept.LOOP_FACTORY}"' in inspect.getsource(cli.cmd_gateway)
