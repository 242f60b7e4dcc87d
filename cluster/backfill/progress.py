"""The backfill's progress bar: one line on stderr with dialogues done, tokens/s and ETA."""

from __future__ import annotations

import time
from typing import TextIO


class Progress:
    """A one-line progress bar on stderr: dialogues done, tokens/s, ETA."""

    def __init__(self, total: int, stream: TextIO, enabled: bool) -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self.tokens = 0
        self._stream = stream
        self._enabled = enabled
        self._tty = stream.isatty()
        self._start = time.monotonic()
        self._last = 0.0

    def update(self, tokens: int = 0, done: int = 0, failed: int = 0) -> None:
        """Count progress; redraw now and then."""
        self.tokens += tokens
        self.done += done
        self.failed += failed
        now = time.monotonic()
        if now - self._last >= (0.25 if self._tty else 10.0):
            self._last = now
            self.draw()

    def line(self) -> str:
        """The progress line."""
        elapsed = max(time.monotonic() - self._start, 1e-9)
        finished = self.done + self.failed
        rate = self.tokens / elapsed
        eta = (self.total - finished) * elapsed / finished if finished else float("nan")
        width = 24
        filled = int(width * finished / self.total) if self.total else width
        eta_text = "--:--" if eta != eta else time.strftime("%H:%M:%S", time.gmtime(eta))
        return (
            f"[{'#' * filled}{'.' * (width - filled)}] {finished}/{self.total} dialogues"
            f" ({self.failed} failed) | {rate:,.1f} tok/s | ETA {eta_text}"
        )

    def draw(self, final: bool = False) -> None:
        """Write the line (over the last one on a terminal)."""
        if not self._enabled:
            return
        end = "\n" if final or not self._tty else ""
        self._stream.write(("\r" if self._tty else "") + self.line() + end)
        self._stream.flush()
