"""A lean HTTP/1.1 streaming client for the load generator: one keep-alive connection per
closed-loop worker, an ``asyncio.Protocol`` that de-chunks the body as it arrives and
splits and parses the SSE events once the response has ended.

Why not httpx: at thousands of concurrent streams the load generator shares the machine
with the server it measures, and httpx's per-line iterators cost several hundred
microseconds of CPU per event, more than the gateway itself. This client parses the same
events (``json.loads`` of every ``data:`` line) and times each at the arrival of the read
that completed it, so TTFT and ITL mean exactly what :func:`cluster.bench.load.one_request`
measures, at a fraction of the cost: the read path only stamps and keeps the bytes, and
the parsing, done later, no longer delays the timestamps of the other streams' reads. It
speaks only what the benchmark needs: POST, a ``Content-Length`` or chunked response
body, keep-alive.
"""

from __future__ import annotations

import asyncio
import json
from time import perf_counter
from typing import Any
from urllib.parse import urlsplit

from cluster.bench.samples import Sample, StreamTimer
from cluster.errors import CharserveError


class ProtocolViolation(CharserveError):
    """The server's response could not be parsed."""


# Parser states: where the next byte of a response belongs.
_IDLE, _HEAD, _SIZE, _DATA, _CRLF, _TRAILER, _LENGTH = range(7)
# The longest status line, header block, chunk-size line or trailer kept while incomplete.
_MAX_LINE_BYTES = 65536
# Body segments kept before they are split and parsed mid-stream (bounds memory per stream).
_MAX_PENDING_SEGMENTS = 128


class _Response:
    """What one request's response carries so far: body segments with the time each
    arrived, split into SSE events and parsed only later (:meth:`feed`)."""

    __slots__ = ("end", "partial", "segments", "status", "timer", "times")

    def __init__(self, start: float) -> None:
        self.timer = StreamTimer(start)
        self.status = 0
        self.times: list[float] = []  # arrival time of each body segment
        self.segments: list[bytes] = []  # the body, as the reads delivered it
        self.partial = b""  # the start of an event whose end has not arrived yet
        self.end = start  # when the response's last bytes arrived

    def feed(self) -> None:
        """Split the segments so far into SSE events, ``json.loads`` each ``data:``
        payload and feed it to the timer at the arrival time of the segment that ended
        its event: what timing and parsing at ``data_received`` would give. A payload
        that is not an OpenAI chunk becomes the sample's error, and events after an
        error are not timed; bytes after the last blank line are an incomplete event,
        which SSE discards."""
        times, segments = self.times, self.segments
        self.times, self.segments = [], []
        timer = self.timer
        if self.status != 200:
            body = self.partial + b"".join(segments)
            self.partial = body[:400]  # the error body, as much as a refusal's holds
            return
        partial = self.partial
        payloads: list[bytes] = []
        arrivals: list[float] = []
        for now, segment in zip(times, segments, strict=True):
            if partial:
                segment = partial + segment
            events = segment.split(b"\n\n")
            partial = events.pop()
            for raw in events:
                at = raw.find(b"data: ")
                if at >= 0:
                    payload = raw[at + 6 :]
                    if payload != b"[DONE]":
                        payloads.append(payload)
                        arrivals.append(now)
        self.partial = partial
        if payloads and not timer.sample.error:
            try:
                _feed_timer(timer, payloads, arrivals)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:  # no OpenAI chunk
                timer.sample.error = f"{type(exc).__name__}: {exc}"

    def sample(self) -> Sample:
        """The measurements of a response that has ended, its events parsed now."""
        self.feed()
        sample = self.timer.sample
        sample.status = self.status
        if self.status != 200:
            sample.error = f"HTTP {self.status}: {self.partial!r}"
            sample.e2e_s = self.end - sample.start_s
            return sample
        return self.timer.finish(self.end)


def _feed_timer(timer: StreamTimer, payloads: list[bytes], arrivals: list[float]) -> None:
    """``json.loads`` every payload on its own (the first bad one raises) and feed the
    timer, with each payload's arrival time, until an error event."""
    for payload, now in zip(payloads, arrivals, strict=True):
        if not timer.event(json.loads(payload), now):
            return


class _StreamProtocol(asyncio.Protocol):
    """Parses one response at a time on a keep-alive connection.

    ``data_received`` only de-chunks: it slices each read's chunk payloads into the
    response's segments, stamped with the read's arrival time, with no copy of the buffer
    and no per-event work; the events are split and parsed after the response has ended
    (:meth:`_Response.feed`), off the path that timestamps the other streams' bytes.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = b""  # an incomplete head, chunk-size line, CRLF or trailer
        self._state = _IDLE
        self._remaining = 0  # bytes left in the current chunk or Content-Length body
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
        self._parse(data, perf_counter())

    # -- requests -------------------------------------------------------------------

    def send(self, request: bytes) -> asyncio.Future[_Response]:
        """Write one request; the future resolves when its response has ended."""
        assert self.transport is not None and self._state == _IDLE
        self._response = _Response(perf_counter())
        self._done = asyncio.get_running_loop().create_future()
        self._state = _HEAD
        self.transport.write(request)
        return self._done

    @property
    def reusable(self) -> bool:
        """True when another request may be sent on this connection."""
        return not self.closed and self._keep_alive and self._state == _IDLE

    # -- parsing --------------------------------------------------------------------

    def _parse(self, data: bytes, now: float) -> None:
        """Take one read: any state, any split of the bytes."""
        if self._buf:
            data = self._buf + data
            self._buf = b""
        response = self._response
        try:
            if response is None or self._state == _IDLE:
                raise ProtocolViolation(f"{len(data)} bytes with no request outstanding")
            times, segments = response.times, response.segments
            state, remaining = self._state, self._remaining
            pos, n = 0, len(data)
            while pos < n:
                if state == _SIZE:
                    eol = data.find(b"\r\n", pos)
                    if eol < 0:
                        break
                    line = data[pos:eol]
                    size = int(line.partition(b";")[0], 16)  # chunk extensions ignored
                    pos = eol + 2
                    if size <= 0:
                        if size < 0:
                            raise ProtocolViolation(f"bad chunk size {line!r}")
                        state = _TRAILER
                        continue
                    stop = pos + size
                    if stop <= n:  # the common case: the whole chunk is in this read
                        times.append(now)
                        segments.append(data[pos:stop])
                        pos, state = stop, _CRLF
                        continue
                    state, remaining = _DATA, size
                elif state == _DATA or state == _LENGTH:
                    take = min(n - pos, remaining)
                    times.append(now)
                    segments.append(data[pos : pos + take])
                    pos += take
                    remaining -= take
                    if not remaining:
                        if state == _LENGTH:
                            state = self._finish(response, now)
                        else:
                            state = _CRLF
                elif state == _CRLF:
                    if n - pos < 2:
                        break
                    if data[pos] != 13 or data[pos + 1] != 10:
                        raise ProtocolViolation("chunk not followed by CRLF")
                    pos += 2
                    state = _SIZE
                elif state == _TRAILER:
                    eol = data.find(b"\r\n", pos)
                    if eol < 0:
                        break
                    if eol == pos:  # the empty line that ends the trailer
                        state = self._finish(response, now)
                    pos = eol + 2
                elif state == _HEAD:
                    eol = data.find(b"\r\n\r\n", pos)
                    if eol < 0:
                        break
                    state, remaining = self._head(response, data[pos:eol])
                    pos = eol + 4
                    if state == _LENGTH and not remaining:
                        state = self._finish(response, now)
                else:
                    raise ProtocolViolation(f"{n - pos} bytes after the response")
            self._state, self._remaining = state, remaining
            if pos < n:
                if n - pos > _MAX_LINE_BYTES:
                    raise ProtocolViolation("header block or chunk-size line too long")
                self._buf = data[pos:]
            if len(times) >= _MAX_PENDING_SEGMENTS:
                response.feed()
        except Exception as exc:  # a parse error ends this request, not the benchmark
            self._keep_alive = False
            if self._done is not None and not self._done.done():
                self._done.set_exception(exc)
            if self.transport is not None:
                self.transport.close()

    def _head(self, response: _Response, head: bytes) -> tuple[int, int]:
        """Read the status line and headers; the next state and the body's length."""
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ProtocolViolation(f"bad status line {lines[0]!r}")
        response.status = int(parts[1])
        chunked, length, self._keep_alive = False, 0, parts[0] == b"HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"transfer-encoding":
                chunked = b"chunked" in value
            elif name == b"content-length":
                length = int(value)
            elif name == b"connection":
                self._keep_alive = value != b"close"
        return (_SIZE, 0) if chunked else (_LENGTH, length)

    def _finish(self, response: _Response, now: float) -> int:
        response.end = now
        if self._done is not None and not self._done.done():
            self._done.set_result(response)
        return _IDLE


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
        return response.sample()

    def close(self) -> None:
        """Close every idle connection."""
        for proto in self._idle:
            if proto.transport is not None:
                proto.transport.close()
        self._idle.clear()
