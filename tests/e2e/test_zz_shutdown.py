"""Runs last: SIGTERM stops everything ``charserve up`` started."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import Stack

pytestmark = pytest.mark.e2e


def test_sigterm_stops_everything(stack: Stack) -> None:
    assert stack.descendants(), "the stack should have started child processes"
    code = stack.stop()
    assert code == 0
    assert stack.leftovers == []
