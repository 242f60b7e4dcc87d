"""Writing a streamed reply's body straight to the client's connection.

An SSE token normally travels the whole ASGI send chain: the streaming response's loop
wakes, awaits ``send`` through every middleware, and uvicorn frames and writes it. At
thousands of streams that chain, run once per token, is most of a gateway's CPU. A
:class:`ConnectionWriter` writes the same HTTP/1.1 chunk (``<size>\\r\\n<data>\\r\\n``)
to the connection's transport directly, from the relay's dispatcher.

It attaches only where that is exactly equivalent: uvicorn's ``httptools`` protocol (the
one ``charserve gateway`` runs), after the response head went out with chunked transfer
encoding. Everything else the ASGI path keeps: the head, the last chunk and its
terminator, errors, and any other server. The raw ``send`` uvicorn gave the application is
kept in the scope under :data:`RAW_SEND` by :class:`~gateway.app.GatewayApp`, since the
middleware wraps the one the route sees.
"""

from __future__ import annotations

from typing import Any

from starlette.types import Send

from cluster.runtime.introspect import missing_names

# The scope key under which the gateway app keeps the server's own ``send``.
RAW_SEND = "charserve.raw_send"
_CYCLE_MODULE = "uvicorn.protocols.http.httptools_impl"
# What the writer reads of uvicorn's request cycle and of its flow control.
_CYCLE_HAS = (
    "response_started",
    "chunked_encoding",
    "response_complete",
    "flow",
    "transport",
    "disconnected",
)
_FLOW_HAS = ("write_paused",)


def check_uvicorn() -> str | None:
    """Why direct writes cannot work with the installed uvicorn (None: they can). The
    gateway logs it once at start; every stream then takes the ASGI path."""
    try:
        from uvicorn.protocols.http.flow_control import FlowControl
        from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
    except ImportError as exc:
        return f"uvicorn's httptools protocol is not available ({exc})"
    missing = missing_names(RequestResponseCycle.__init__, _CYCLE_HAS)
    missing += [f"FlowControl.{n}" for n in missing_names(FlowControl.__init__, _FLOW_HAS)]
    if missing:
        import uvicorn

        return (
            f"uvicorn {uvicorn.__version__} changed its request cycle "
            f"(missing: {', '.join(missing)})"
        )
    return None


class ConnectionWriter:
    """Writes body chunks of one started, chunked HTTP/1.1 response to its transport."""

    __slots__ = ("_cycle", "_flow", "_transport")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._flow = cycle.flow
        self._transport = cycle.transport

    @classmethod
    def attach(cls, raw_send: Send | None) -> ConnectionWriter | None:
        """A writer for the response ``raw_send`` belongs to, or None when direct writes
        would not be exactly what ``send`` does (another server or protocol, a response
        not started, or not chunked)."""
        cycle = getattr(raw_send, "__self__", None)
        if type(cycle).__module__ != _CYCLE_MODULE:
            return None
        if not (
            getattr(cycle, "response_started", False)
            and getattr(cycle, "chunked_encoding", None) is True
            and not getattr(cycle, "response_complete", True)
            and hasattr(cycle, "flow")
            and hasattr(cycle, "transport")
        ):
            return None
        return cls(cycle)

    def write(self, data: bytes) -> bool:
        """Write ``data`` as one body chunk now. False, writing nothing, when the client is
        gone or its socket is backed up (the ASGI path then waits for it, bounded)."""
        if self._cycle.disconnected or self._flow.write_paused:
            return False
        self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return True
