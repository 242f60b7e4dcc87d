"""The gateway's HTTP server protocol: uvicorn's httptools protocol with a bound on the time
a client may take to send a request's headers.

uvicorn times out only idle keep-alive connections: a client that opens a connection and
sends its headers a byte at a time (or never) holds a connection and its buffers for as
long as it likes, and enough such clients exhaust the server. Here each request's headers
must arrive within :attr:`HeaderTimeoutProtocol.header_timeout_s` of its first byte (of the
connection, for the first request); the connection is closed otherwise. ``charserve
gateway`` runs uvicorn with this protocol (``http="gateway.http.server:HeaderTimeoutProtocol"``).
"""

from __future__ import annotations

import asyncio

import structlog
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = structlog.get_logger(__name__)

PROTOCOL = "gateway.http.server:HeaderTimeoutProtocol"


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """httptools with a header-read timeout (set from settings when the app is built)."""

    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        log.info("closing a connection whose request headers did not arrive in time")
        self.transport.close()
