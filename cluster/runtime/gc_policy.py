"""The garbage collector of long-running serving processes (gateway, worker, load generator).

Two things keep collector pauses off the token path:

- :func:`settle` freezes everything built at start-up (the tokenizer, transformers, Ray,
  the app), so a full collection scans only what requests allocate. One full collection
  of the start-up heap stalled every stream of a gateway for about 200 ms.
- It also spaces collections out: a serving process allocates short-lived objects at a
  high rate (chunks, events, futures), and with CPython's default thresholds (700, 10,
  10) it ran a young collection every few ms and a full one every 10-20 s under load,
  each full one pausing every stream for 40-90 ms at 500 streams. Young collections
  every :data:`YOUNG_ALLOCATIONS` allocations and full ones at most every
  :data:`FULL_EVERY` middle ones keep pauses rare; reference counting still frees
  almost everything at once, so memory stays flat.
"""

from __future__ import annotations

import gc

YOUNG_ALLOCATIONS = 10_000
MIDDLE_EVERY = 20
FULL_EVERY = 100


def settle() -> None:
    """Call once the process has finished starting: freeze the start-up heap and space
    collections out."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_ALLOCATIONS, MIDDLE_EVERY, FULL_EVERY)
