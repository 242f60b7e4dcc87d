"""SSE framing: the lean content-event path writes exactly what the general path writes."""

from __future__ import annotations

import json

import pytest

from gateway.sse import ChunkFormatter
from tests.fakes import make_chunk


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize(
    "text", [" plain", 'quo"te \\ back', "line\nbreak\t", "héllo ✓ 🚀", "\x00"]
)
def test_content_events_match_the_general_path(include_usage: bool, text: str) -> None:
    fmt = ChunkFormatter("chatcmpl-x", 'm"odel', 1700000000, include_usage)
    fmt.render(make_chunk(1, "first"))  # the role goes with the first event
    lean = fmt.render(make_chunk(7, text))
    general = fmt._event(
        7, [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]
    )
    assert lean == general
    assert lean.startswith(b"id: 7\ndata: ") and lean.endswith(b"\n\n")
    body = json.loads(lean.split(b"data: ", 1)[1])
    assert body["choices"][0]["delta"] == {"content": text}
    assert ("usage" in body) is include_usage


def test_first_and_last_events_keep_role_finish_and_usage() -> None:
    fmt = ChunkFormatter("chatcmpl-x", "m", 1, True)
    first = json.loads(fmt.render(make_chunk(1, "a")).split(b"data: ", 1)[1])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    last = fmt.render(make_chunk(2, "b", finish_reason="length")).split(b"\n\n")
    finish = json.loads(last[1].split(b"data: ", 1)[1])
    usage = json.loads(last[2].split(b"data: ", 1)[1])
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2
    assert last[3] == b"data: [DONE]"
