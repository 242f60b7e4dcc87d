"""The persona conversations of ``charserve bench-peers --workload persona``: the personas
are deterministic and about the asked length, a turn sends the whole history with the real
replies, and the summary keeps turn 1 apart from later turns."""

from __future__ import annotations

import json
import math

import httpx
from transformers import AutoTokenizer

from cluster.bench.conversations import converse, persona_text, summarize
from cluster.bench.samples import Sample


def test_personas_are_deterministic_distinct_and_about_the_asked_length(model_path: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    assert persona_text(2, 900, seed=5) == persona_text(2, 900, seed=5)
    texts = {persona_text(i, 900, seed) for i in range(4) for seed in (1, 8, 32)}
    assert len(texts) == 12
    for tokens in (300, 900):
        counts = [len(tokenizer(persona_text(i, tokens, 3))["input_ids"]) for i in range(6)]
        assert all(0.93 * tokens <= n <= 1.07 * tokens for n in counts), counts


HEADERS = {"X-Priority": "standard"}


def _sse(reply: str) -> bytes:
    events = [{"choices": [{"delta": {"content": word}}]} for word in reply.split(" ")] + [
        {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 10}}
    ]
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


async def test_a_turn_sends_the_history_with_real_replies_and_skips_refused_ones() -> None:
    bodies: list[dict[str, object]] = []
    seen_headers: list[httpx.Headers] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        seen_headers.append(request.headers)
        if len(bodies) == 2:
            return httpx.Response(429, json={"error": {"message": "busy"}})
        return httpx.Response(200, content=_sse(f"reply {len(bodies)} ok"))

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        turns = await converse(
            client, "http://x", "m", "PERSONA", 3, 3, conversation=4, seed=1, headers=HEADERS
        )
    assert [t for t, _ in turns] == [0, 1, 2]
    assert [h["x-priority"] for h in seen_headers] == ["standard"] * 3
    assert [s.status for _, s in turns] == [200, 429, 200]
    assert all(b["ignore_eos"] and b["max_tokens"] == 3 for b in bodies)
    assert bodies[0]["stream_options"] == {"include_usage": True}
    first, third = bodies[0]["messages"], bodies[2]["messages"]
    assert isinstance(first, list) and isinstance(third, list)
    assert first[0] == {"role": "system", "content": "PERSONA"} and len(first) == 2
    # Turn 2 was refused: turn 3 carries turn 1 and its reply, then its own message.
    assert third[:3] == [*first, {"role": "assistant", "content": "reply1ok"}]
    assert len(third) == 4 and third[3]["content"].startswith("(#4.2) ")


def _sample(ttft_s: float, status: int = 200) -> Sample:
    ok = status == 200
    return Sample(ok=ok, ttft_s=ttft_s, output_tokens=64 if ok else 0, itl_s=[0.05, 0.07],
                  status=status, error="" if ok else "HTTP 429: b'busy'")  # fmt: skip


def test_the_summary_keeps_turn_one_apart_and_counts_refusals() -> None:
    turns = [(0, _sample(1.0)), (0, _sample(1.2)), (1, _sample(0.2)), (2, _sample(0.3)),
             (1, _sample(0, status=429))]  # fmt: skip
    s = summarize(turns, 10.0, 12.0)
    assert s["ttft_first_p50_ms"] == 1100.0 and s["ttft_later_p50_ms"] == 250.0
    assert s["ttft_p50_ms"] == 650.0
    assert (s["errors"], s["refused"], s["turns"]) == (1, 1, 5)
    assert s["output_tokens_per_s"] == 128.0 and s["itl_p50_ms"] == 60.0
    assert s["first_refusal"].startswith("HTTP 429") and s["window"]["end_s"] == 12.0
    assert math.isnan(summarize([], 0.0, 1.0)["ttft_p50_ms"])
