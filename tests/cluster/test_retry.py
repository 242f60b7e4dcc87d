"""Retry hints: what a refusal's headers say, and how charserve's own clients read them."""

from __future__ import annotations

import httpx
import pytest

from cluster.wire.retry import MAX_RETRY_AFTER_MS, hinted_retry_s, retry_headers


@pytest.mark.parametrize(
    ("wait_ms", "seconds", "ms"),
    [
        (365.2, "1", "366"),  # rounded up, both
        (2_000.0, "2", "2000"),
        (2_000.5, "3", "2001"),
        (0.0, "1", "1"),  # never "come back now"
        (-5.0, "1", "1"),
        (1e12, "86400", str(MAX_RETRY_AFTER_MS)),  # at most a day
    ],
)
def test_both_headers_say_the_same_wait(wait_ms: float, seconds: str, ms: str) -> None:
    assert retry_headers(wait_ms) == {"Retry-After": seconds, "retry-after-ms": ms}


def test_the_milliseconds_are_read_first_in_any_case() -> None:
    assert hinted_retry_s({"Retry-After": "2", "retry-after-ms": "366"}) == 0.366
    assert hinted_retry_s(httpx.Headers({"retry-after": "2", "Retry-After-Ms": "366"})) == 0.366
    assert hinted_retry_s({"retry-after": "2"}) == 2.0


@pytest.mark.parametrize(
    "headers",
    [{}, {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}, {"retry-after-ms": "-1"}],
)
def test_no_plain_number_is_no_hint(headers: dict[str, str]) -> None:
    assert hinted_retry_s(headers) is None


def test_a_bad_milliseconds_header_falls_back_to_the_seconds() -> None:
    assert hinted_retry_s({"retry-after-ms": "soon", "Retry-After": "3"}) == 3.0
