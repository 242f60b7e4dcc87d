"""Start-up checks for the few places charserve reaches into another library's internals.

Each such reach lives in one small adapter (Ray Serve's deploy API, vLLM's scheduler,
uvicorn's request cycle) that checks, when its process starts, that what it uses still
exists, and says which version it expected, instead of failing on the first request, or
silently doing nothing after an upgrade renamed an attribute.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any


def names_used(function: Callable[..., Any]) -> set[str]:
    """Every attribute and global name ``function``'s code uses, nested functions and
    comprehensions included (``self.x`` read or written shows up as ``x``)."""
    code = getattr(function, "__code__", None)
    if code is None:
        return set()

    def walk(code: types.CodeType) -> set[str]:
        found = set(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found |= walk(const)
        return found

    return walk(code)


def missing_names(function: Callable[..., Any], expected: Iterable[str]) -> list[str]:
    """The names of ``expected`` that ``function`` does not use."""
    used = names_used(function)
    return [name for name in expected if name not in used]
