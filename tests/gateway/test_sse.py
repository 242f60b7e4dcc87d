"""SSE framing: the lean content-event path writes exactly what the general path writes."""

from __future__ import annotations

import json

import pytest

from gateway.streaming.sse import ChunkFormatter
from tests.fakes import make_chunk


@pytest.mark.parametrize("event_ids", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize(
    "text", [" plain", 'quo"te \\ back', "line\nbreak\t", "héllo ✓ 🚀", "\x00"]
)
def test_content_events_match_the_general_path(
    include_usage: bool, text: str, event_ids: bool
) -> None:
    fmt = ChunkFormatter("chatcmpl-x", 'm"odel', 1700000000, include_usage, event_ids=event_ids)
    fmt.render(make_chunk(1, "first"))  # the role goes with the first event
    lean = fmt.render(make_chunk(7, text))
    general = fmt._event(
        7, [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]
    )
    assert lean == general
    head = b"id: 7\ndata: " if event_ids else b"data: "
    assert lean.startswith(head) and lean.endswith(b"\n\n")
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


def test_events_are_framed_as_openai_frames_them_unless_ids_are_asked_for() -> None:
    plain = ChunkFormatter("chatcmpl-x", "m", 1, True)
    with_ids = ChunkFormatter("chatcmpl-x", "m", 1, True, event_ids=True)
    for n, fmt in enumerate((plain, with_ids)):
        raw = b"".join(
            fmt.render(c)
            for c in (
                make_chunk(1, "a"),
                make_chunk(2, "b"),
                make_chunk(3, "c", finish_reason="stop"),
            )
        )
        events = raw.split(b"\n\n")[:-1]
        ids = [e.split(b"\n", 1)[0] for e in events if e.startswith(b"id: ")]
        if n == 0:
            # Every event is one data line: a blank-line splitter that strips "data: " reads
            # each one.
            assert ids == [] and all(e.startswith(b"data: ") for e in events)
            assert all(b"\n" not in e for e in events)
        else:
            assert ids == [b"id: 1", b"id: 2", b"id: 3", b"id: 3", b"id: 3"]


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_a_token_without_text_yet_still_gets_its_event(kind: str) -> None:
    """The first byte of a multi-byte character decodes to no text: the step's event goes
    out with empty content (as vLLM's server sends it), so a client counting events sees
    one event per step; the character arrives whole with the next token."""
    fmt = ChunkFormatter("chatcmpl-x", "m", 1, False, kind=kind)  # type: ignore[arg-type]
    fmt.render(make_chunk(1, "a"))
    partial = make_chunk(2, "", token_ids=[2])
    events = fmt.render(partial).split(b"\n\n")[:-1]
    assert len(events) == 1
    choice = json.loads(events[0].split(b"data: ", 1)[1])["choices"][0]
    if kind == "chat":
        assert choice["delta"] == {"content": ""}
    else:
        assert choice["text"] == ""
    assert choice["finish_reason"] is None


def test_a_chunk_with_no_token_and_a_final_one_without_text_add_no_content_event() -> None:
    fmt = ChunkFormatter("chatcmpl-x", "m", 1, False)
    fmt.render(make_chunk(1, "a"))
    assert fmt.render(make_chunk(2, "")) == b""  # nothing new: no event
    final = fmt.render(make_chunk(3, "", token_ids=[3], finish_reason="stop")).split(b"\n\n")
    finish = json.loads(final[0].split(b"data: ", 1)[1])["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "stop"
    assert final[1:] == [b"data: [DONE]", b""]
