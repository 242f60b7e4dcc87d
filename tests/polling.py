"""Waiting for state that has no event to wait on (state inside Redis, a periodic snapshot)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def eventually(
    check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0, every_s: float = 0.02
) -> None:
    """Poll ``check`` until it returns True; fail with TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(every_s)
    raise TimeoutError(f"condition not met within {timeout_s} s")


class Signal:
    """Something that changes now and then, and a way to wait for a predicate on it
    without polling: call :meth:`touch` on every change."""

    def __init__(self) -> None:
        self._changed = asyncio.Event()

    def touch(self) -> None:
        """Note a change: waiters re-check their predicate."""
        self._changed.set()

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        """Wait until ``predicate()`` holds after some change (TimeoutError after
        ``timeout_s``)."""
        async with asyncio.timeout(timeout_s):
            while not predicate():
                self._changed.clear()
                await self._changed.wait()
