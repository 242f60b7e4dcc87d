"""A rendered prompt's token ids, piece by piece between special tokens, with the pieces'
ids kept.

A fast tokenizer first cuts its text at the special tokens the chat template placed
(``<|im_start|>``, ``<|im_end|>``) and then encodes each piece between them on its own.
In character chat most pieces come back every turn: the persona, the conversation so far,
the role headers. :class:`PieceEncoder` cuts the text at the same places, and takes each
piece's ids from a bounded LRU when it has seen the piece before, so a turn encodes only
what is new in it (the latest message), not the whole history again.

It is used only where that is exactly what the tokenizer does (:meth:`PieceEncoder.of`):
no normalizer, and special tokens that neither strip nor match whole words only; and the
ids of a probe text must come out the same both ways. Otherwise the caller encodes the
whole text as before.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

# Texts that probe, at start-up, that piecewise ids equal the tokenizer's own: spaces and
# newlines at the edges of pieces, text around and between special tokens, non-ASCII.
_PROBE_PIECES = (
    "system\nYou are Mara, a ship's captain.",
    "\n",
    "user\n  Hello there!  ",
    " ",
    "assistant\n",
    "\u00e9t\u00e9 \u2014 caf\u00e9 \U0001f600\n\n",
    "",
)


class PieceEncoder:
    """Token ids of a rendered prompt, with the ids of recently seen pieces kept.

    ``max_chars`` bounds the characters of all kept pieces together (and so the memory);
    a piece longer than ``max_piece_chars`` is encoded every time and never kept. Safe to
    call from the event loop and from worker threads at once.
    """

    def __init__(
        self,
        backend: Any,
        special: dict[str, int],
        *,
        max_chars: int = 2_000_000,
        max_piece_chars: int = 65_536,
    ) -> None:
        self._backend = backend
        self._special = dict(special)
        # Longest first: a regex alternation takes the first alternative that matches, so
        # this finds the leftmost-longest special token, as the tokenizer does.
        ordered = sorted(self._special, key=len, reverse=True)
        self._cut = re.compile("|".join(re.escape(token) for token in ordered))
        self._kept: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._kept_chars = 0
        self._max_chars = max_chars
        self._max_piece_chars = max_piece_chars
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @classmethod
    def of(cls, backend: Any, **bounds: int) -> PieceEncoder | None:
        """An encoder for ``backend`` (a ``tokenizers.Tokenizer``), or None where cutting
        at special tokens could give other ids than the tokenizer's own."""
        if backend is None or getattr(backend, "normalizer", None) is not None:
            return None
        added = backend.get_added_tokens_decoder()
        if not added:
            return None
        special: dict[str, int] = {}
        for token_id, token in added.items():
            if token.lstrip or token.rstrip or token.single_word or not token.content:
                return None
            special[token.content] = int(token_id)
        encoder = cls(backend, special, **bounds)
        tokens = sorted(special, key=len)[:3]
        probe = "".join(p + tokens[i % len(tokens)] for i, p in enumerate(_PROBE_PIECES))
        probe = tokens[-1] + probe + _PROBE_PIECES[0]
        whole = list(backend.encode(probe, add_special_tokens=False).ids)
        if encoder.encode(probe) != whole:
            return None
        encoder.clear()
        return encoder

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids, special tokens included as the template placed them."""
        ids: list[int] = []
        at = 0
        for match in self._cut.finditer(text):
            start = match.start()
            if start > at:
                ids.extend(self._piece(text[at:start]))
            ids.append(self._special[match.group()])
            at = match.end()
        if at < len(text):
            ids.extend(self._piece(text[at:]))
        return ids

    def clear(self) -> None:
        """Forget every kept piece."""
        with self._lock:
            self._kept.clear()
            self._kept_chars = 0
            self.hits = self.misses = 0

    @property
    def kept_chars(self) -> int:
        """Characters of the pieces kept now."""
        return self._kept_chars

    def _piece(self, piece: str) -> tuple[int, ...]:
        with self._lock:
            ids = self._kept.get(piece)
            if ids is not None:
                self._kept.move_to_end(piece)
                self.hits += 1
                return ids
            self.misses += 1
        ids = tuple(self._backend.encode(piece, add_special_tokens=False).ids)
        if len(piece) > self._max_piece_chars:
            return ids
        with self._lock:
            if piece not in self._kept:
                self._kept[piece] = ids
                self._kept_chars += len(piece)
                while self._kept_chars > self._max_chars:
                    dropped, _ = self._kept.popitem(last=False)
                    self._kept_chars -= len(dropped)
        return ids
