"""A lean HTTP/1.1 streaming client for the load generator: one keep-alive connection per
closed-loop worker, an ``asyncio.Protocol`` that de-chunks the body and splits SSE events
in place.

Why not httpx: at thousands of concurrent streams the load generator shares the machine
with the server it measures, and httpx's per-line iterators cost several hundred
microseconds of CPU per event, more than the gateway itself. This client parses the same
events (``json.loads`` of every ``data:`` line) and times them when their bytes arrive,
so TTFT and ITL mean exactly what :func:`cluster.bench.one_request` measures, at a
fraction of the cost. It speaks only what the benchmark needs: POST, a
``Content-Length`` or chunked response body, keep-alive.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlsplit

from cluster.bench import Sample, StreamTimer


class ProtocolViolation(Exception):
    """The server's response could not be parsed."""


class _Response:
    """What one request's response carries so far."""

    __slots__ = ("body", "status", "timer")

    def __init__(self, start: float) -> None:
        self.timer = StreamTimer(start)
        self.status = 0
        self.body = bytearray()  # a non-200 body, for the error message


class _StreamProtocol(asyncio.Protocol):
    """Parses one response at a time on a keep-alive connection."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._events = bytearray()
        self._state = "idle"  # idle, head, chunk_size, chunk_data, length, done
        self._remaining = 0
        self._chunked = False
        self._keep_alive = True
        self._response: _Response | None = None
        self._done: asyncio.Future[_Response] | None = None
        self.closed = False

    # -- asyncio.Protocol -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._done is not None and not self._done.done():
            self._done.set_exception(ConnectionError(f"connection lost: {exc}"))

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self._buf += data
        try:
            self._parse(now)
        except Exception as exc:  # a parse error ends this request, not the benchmark
            if self._done is not None and not self._done.done():
                self._done.set_exception(exc)
            if self.transport is not None:
                self.transport.close()

    # -- requests -------------------------------------------------------------------

    def send(self, request: bytes) -> asyncio.Future[_Response]:
        """Write one request; the future resolves when its response has ended."""
        assert self.transport is not None and self._state == "idle"
        self._response = _Response(time.perf_counter())
        self._done = asyncio.get_running_loop().create_future()
        self._state = "head"
        self.transport.write(request)
        return self._done

    @property
    def reusable(self) -> bool:
        """True when another request may be sent on this connection."""
        return not self.closed and self._keep_alive and self._state == "idle"

    # -- parsing --------------------------------------------------------------------

    def _parse(self, now: float) -> None:
        buf = self._buf
        while True:
            if self._state == "head":
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                self._head(bytes(buf[:end]))
                del buf[: end + 4]
            elif self._state == "chunk_size":
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                size = int(bytes(buf[:end]).split(b";", 1)[0], 16)
                del buf[: end + 2]
                if size == 0:
                    self._state = "trailer"
                else:
                    self._remaining = size
                    self._state = "chunk_data"
            elif self._state == "chunk_data":
                if len(buf) < self._remaining + 2:
                    # Take what is here; the event splitter works on partial data.
                    take = min(len(buf), self._remaining)
                    if take:
                        self._body(bytes(buf[:take]), now)
                        del buf[:take]
                        self._remaining -= take
                    if self._remaining or len(buf) < 2:
                        return
                self._body(bytes(buf[: self._remaining]), now)
                del buf[: self._remaining + 2]
                self._remaining = 0
                self._state = "chunk_size"
            elif self._state == "trailer":
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                del buf[: end + 2]
                if end == 0:
                    self._finish()
            elif self._state == "length":
                take = min(len(buf), self._remaining)
                if take:
                    self._body(bytes(buf[:take]), now)
                    del buf[:take]
                    self._remaining -= take
                if self._remaining:
                    return
                self._finish()
            else:
                return

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ProtocolViolation(f"bad status line {lines[0]!r}")
        assert self._response is not None
        self._response.status = int(parts[1])
        self._chunked, length, self._keep_alive = False, 0, parts[0] == b"HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"transfer-encoding":
                self._chunked = b"chunked" in value
            elif name == b"content-length":
                length = int(value)
            elif name == b"connection":
                self._keep_alive = value != b"close"
        if self._chunked:
            self._state = "chunk_size"
        else:
            self._remaining = length
            self._state = "length"
            if length == 0:
                self._finish()

    def _body(self, data: bytes, now: float) -> None:
        response = self._response
        assert response is not None
        if response.status != 200:
            response.body += data[: max(0, 200 - len(response.body))]
            return
        events = self._events
        events += data
        start = 0
        while True:
            end = events.find(b"\n\n", start)
            if end < 0:
                break
            self._event(bytes(events[start:end]), now)
            start = end + 2
        if start:
            del events[:start]

    def _event(self, event: bytes, now: float) -> None:
        response = self._response
        assert response is not None
        if response.timer.sample.error:
            return
        at = event.find(b"data: ")
        if at < 0:
            return
        payload = event[at + 6 :]
        if payload != b"[DONE]":
            response.timer.event(json.loads(payload), now)

    def _finish(self) -> None:
        self._state = "idle"
        self._events.clear()
        if self._done is not None and not self._done.done() and self._response is not None:
            self._done.set_result(self._response)


class LeanClient:
    """Keep-alive connections to one server, one per concurrent caller."""

    def __init__(self, base_url: str) -> None:
        url = urlsplit(base_url)
        if url.scheme != "http" or url.hostname is None:
            raise ValueError(f"the lean client speaks plain http only, not {base_url!r}")
        self._host = url.hostname
        self._port = url.port or 80
        self._prefix = url.path.rstrip("/")
        self._authority = f"{self._host}:{self._port}".encode()
        self._idle: list[_StreamProtocol] = []

    def request_bytes(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> bytes:
        """A complete HTTP/1.1 POST of ``body`` as JSON."""
        payload = json.dumps(body).encode()
        lines = [
            f"POST {self._prefix}{path} HTTP/1.1".encode(),
            b"Host: " + self._authority,
            b"Content-Type: application/json",
            b"Accept: text/event-stream",
            f"Content-Length: {len(payload)}".encode(),
            *(f"{k}: {v}".encode() for k, v in headers.items()),
        ]
        return b"\r\n".join(lines) + b"\r\n\r\n" + payload

    async def _connection(self) -> _StreamProtocol:
        while self._idle:
            proto = self._idle.pop()
            if proto.reusable:
                return proto
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(_StreamProtocol, self._host, self._port)
        return proto

    async def stream(self, request: bytes, timeout_s: float = 600.0) -> Sample:
        """Send ``request`` and time its SSE reply (a :class:`Sample`, never an exception)."""
        proto: _StreamProtocol | None = None
        try:
            proto = await self._connection()
            response = await asyncio.wait_for(proto.send(request), timeout_s)
        except (OSError, ConnectionError, TimeoutError, ProtocolViolation, ValueError) as exc:
            if proto is not None and proto.transport is not None:
                proto.transport.close()
            return Sample(ok=False, error=f"{type(exc).__name__}: {exc}")
        if proto.reusable:
            self._idle.append(proto)
        elif proto.transport is not None:
            proto.transport.close()
        if response.status != 200:
            response.timer.sample.error = f"HTTP {response.status}: {bytes(response.body)!r}"
            return response.timer.sample
        return response.timer.finish(time.perf_counter())

    def close(self) -> None:
        """Close every idle connection."""
        for proto in self._idle:
            if proto.transport is not None:
                proto.transport.close()
        self._idle.clear()
