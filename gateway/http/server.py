"""The gateway's HTTP server protocol: uvicorn's httptools protocol with a bound on the time
a client may take to send a request's headers.

uvicorn times out only idle keep-alive connections: a client that opens a connection and
sends its headers a byte at a time (or never) holds a connection and its buffers for as
long as it likes, and enough such clients exhaust the server. Here each request's headers
must arrive within the app's ``state.header_timeout_s`` of its first byte (of the
connection, for the first request); the connection is closed otherwise. ``charserve
gateway`` runs uvicorn with this protocol (``http="gateway.http.server:HeaderTimeoutProtocol"``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = structlog.get_logger(__name__)

PROTOCOL = "gateway.http.server:HeaderTimeoutProtocol"


DEFAULT_HEADER_TIMEOUT_S = 10.0


def header_timeout_s(app: Any) -> float:
    """The app's ``state.header_timeout_s``, looking through the middleware uvicorn wraps
    around it (the gateway app sets it from its settings)."""
    for _ in range(8):
        state = getattr(app, "state", None)
        found = getattr(state, "header_timeout_s", None)
        if isinstance(found, int | float):
            return float(found)
        app = getattr(app, "app", None)
        if app is None:
            break
    return DEFAULT_HEADER_TIMEOUT_S


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """httptools with a header-read timeout (the app's, from its settings)."""

    _header_timer: asyncio.TimerHandle | None = None
    _header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timeout_s = header_timeout_s(self.app)
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
            self._header_timer = self.loop.call_later(self._header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        log.info(
            "closing a connection whose request headers did not arrive in time",
            timeout_s=self._header_timeout_s,
        )
        self.transport.close()
