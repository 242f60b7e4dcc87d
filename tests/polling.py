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
