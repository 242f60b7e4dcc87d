"""Several choices for one request (``n`` > 1): one job per choice, replies merged.

vLLM serves ``n`` > 1 by fanning a request out into ``n`` child requests in its engine; the
gateway does the same one level up, so each choice is an ordinary job: admitted, queued,
claimed (by any replica, each with its own prefix cache hit on the shared prompt), relayed
and cancelled like any other, and counted as one job in the metrics and logs. This module
merges their replies into the one response OpenAI gives:

- streamed, the choices' events interleave as their tokens arrive, each event carrying its
  choice's ``index``; each choice ends with its own finish event; the usage chunk
  (``stream_options.include_usage``) comes once, after the last choice, with the prompt
  counted once and the completions summed; then ``[DONE]``;
- whole, one body with the choices in index order and the usage summed the same way.

An error in any choice before the response started is the response's error status; after,
it is an error event that ends the stream. Either way the other choices are cancelled: a
request is served whole or not at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import structlog
from fastapi.responses import StreamingResponse

from cluster.wire.protocol import Chunk
from cluster.wire.vocabulary import Outcome
from gateway.chat.call import SSE_HEADERS, ChatCall, Receive, race_disconnect
from gateway.http.errors import APIError, GatewayTimeout, SlowClient, from_worker
from gateway.streaming.relay import SlowConsumer
from gateway.streaming.response import EndingResponse
from gateway.streaming.sse import (
    DONE,
    KEEPALIVE,
    KEEPALIVE_END,
    ChunkFormatter,
    error_event,
    summed_usage,
)

log = structlog.get_logger(__name__)

# What a choice's pump hands the merge: its index, and a chunk or the error that ended it.
_Item = tuple[int, Chunk | None, BaseException | None]


class Choices:
    """The calls of one request's choices, index order; the first is the request's own."""

    def __init__(self, calls: Sequence[ChatCall]) -> None:
        self.calls = list(calls)

    def end(self, outcome: Outcome) -> None:
        """End every call not ended yet (cancelling its job if it may still run)."""
        for call in self.calls:
            call.end(outcome)

    async def collect(self, first: Chunk, receive: Receive) -> list[tuple[str, Chunk]]:
        """Every choice's whole text and final chunk; ``first`` is the first call's first
        chunk. Any choice's error is raised (the others cancelled)."""

        async def one(index: int, call: ChatCall) -> tuple[str, Chunk]:
            start = first if index == 0 else await call.arrival()
            text, final = await call.whole(start)
            if final.error_code is not None:
                raise from_worker(final.error_code, final.error_message)
            call.end(Outcome.COMPLETED)
            return text, final

        try:
            replies = await race_disconnect(
                asyncio.gather(*(one(i, call) for i, call in enumerate(self.calls))), receive
            )
        except BaseException as exc:
            self.end(_outcome(exc))
            if isinstance(exc, TimeoutError):
                raise GatewayTimeout("no reply from any worker in time") from exc
            raise
        return list(replies)

    def stream(
        self,
        first: Chunk | None,
        formatters: Sequence[ChunkFormatter],
        include_usage: bool,
        headers: dict[str, str],
        keepalive_s: float,
    ) -> StreamingResponse:
        """The SSE response of the merged choices; it owns the calls from here on. ``first``
        is the first call's first chunk, or None when it is still on its way (keep-alives
        go out until some choice's first event does)."""
        body = self._events(first, formatters, include_usage, keepalive_s)
        return _ChoicesResponse(self, body, headers)

    async def _events(
        self,
        first: Chunk | None,
        formatters: Sequence[ChunkFormatter],
        include_usage: bool,
        keepalive_s: float,
    ) -> AsyncIterator[bytes]:
        # Bounded: a client that reads slowly holds the pumps back, so each reply's own
        # buffer fills and the relay's slow-consumer bound applies as for one choice.
        merged: asyncio.Queue[_Item] = asyncio.Queue(maxsize=len(self.calls))
        pumps = [
            asyncio.ensure_future(_pump(i, call, first if i == 0 else None, merged))
            for i, call in enumerate(self.calls)
        ]
        finals: dict[int, Chunk] = {}
        lead = b""
        try:
            if first is None:
                lead = KEEPALIVE_END
                yield KEEPALIVE
            while len(finals) < len(self.calls):
                if lead and keepalive_s > 0:
                    try:
                        index, chunk, exc = await asyncio.wait_for(merged.get(), keepalive_s)
                    except TimeoutError:
                        yield KEEPALIVE
                        continue
                else:
                    index, chunk, exc = await merged.get()
                if chunk is None or chunk.error_code is not None:
                    failure = _failure(chunk, exc)
                    self.end(_outcome(exc) if chunk is None else Outcome.of_error(chunk.error_code))
                    yield lead + error_event(failure.body()) + DONE
                    return
                out = formatters[index].events(chunk)
                if chunk.is_final:
                    finals[index] = chunk
                    self.calls[index].end(Outcome.COMPLETED)
                    if len(finals) == len(self.calls):
                        if include_usage:
                            ordered = [finals[i] for i in range(len(self.calls))]
                            out += formatters[0].usage_event(chunk.seq, summed_usage(ordered))
                        out += DONE
                yield lead + out
                lead = b""
        finally:
            for pump in pumps:
                pump.cancel()


async def _pump(index: int, call: ChatCall, first: Chunk | None, out: asyncio.Queue[_Item]) -> None:
    """Hand one choice's chunks to the merge, up to its final one or its error."""
    try:
        chunk = first if first is not None else await call.arrival()
        await out.put((index, chunk, None))
        while not chunk.is_final:
            chunk = await call.next_chunk()
            await out.put((index, chunk, None))
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        await out.put((index, None, exc))


def _outcome(exc: BaseException | None) -> Outcome:
    """How a choice that ended with ``exc`` (None: its reply said why) ends its request."""
    if isinstance(exc, TimeoutError | GatewayTimeout):
        return Outcome.TIMEOUT
    if isinstance(exc, SlowConsumer):
        return Outcome.SLOW_CONSUMER
    if exc is None or isinstance(exc, asyncio.CancelledError):
        return Outcome.CANCELLED
    return Outcome.ERROR


def _failure(chunk: Chunk | None, exc: BaseException | None) -> APIError:
    """The error event a failed choice ends the stream with."""
    if chunk is not None:
        return from_worker(chunk.error_code, chunk.error_message)
    if isinstance(exc, TimeoutError):
        return GatewayTimeout("the reply stopped arriving")
    if isinstance(exc, SlowConsumer):
        return SlowClient(f"{exc}; the reply was cancelled")
    log.error("a choice's reply failed", error=repr(exc))
    return APIError(f"the reply failed: {exc}")


class _ChoicesResponse(EndingResponse):
    """A merged stream that ends its calls when the response is over, however it ends."""

    def __init__(self, choices: Choices, body: AsyncIterator[bytes], headers: dict[str, str]):
        super().__init__(body, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        self._choices = choices

    def ended(self) -> None:
        """End every choice's call (cancelled, unless it ended already)."""
        self._choices.end(Outcome.CANCELLED)
