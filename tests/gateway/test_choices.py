"""``n`` > 1 through real uvicorn, Redis and the consumer loop: one job per choice, the
replies merged as OpenAI sends them, streamed and whole, chat and text, and every choice
cancelled with its request."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.conftest import Gateway
from tests.gateway.test_chat import MESSAGES, MODEL, sse_events


def chunks_of(raw: str) -> list[dict[str, Any]]:
    events = sse_events(raw)
    assert events[-1] == (None, "[DONE]")
    assert all(event_id is None for event_id, _ in events)
    return [json.loads(data) for _, data in events[:-1]]


async def test_whole_reply_has_n_choices_and_summed_usage(
    http: httpx.AsyncClient, gateway: Gateway
) -> None:
    resp = await http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "n": 3},
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert {c["message"]["content"] for c in body["choices"]} == {" t0 t1 t2"}
    assert {c["finish_reason"] for c in body["choices"]} == {"length"}
    usage = body["usage"]
    assert usage["completion_tokens"] == 9
    assert usage["total_tokens"] == usage["prompt_tokens"] + 9
    # One job per choice, the first the request's own id, all with the same prompt.
    rid = resp.headers["x-request-id"]
    ids = [rid, f"{rid}.1", f"{rid}.2"]
    assert all(i in gateway.engine.jobs for i in ids)
    prompts = {tuple(gateway.engine.jobs[i].prompt_token_ids) for i in ids}
    assert len(prompts) == 1 and usage["prompt_tokens"] == len(next(iter(prompts)))


async def test_stream_interleaves_choices_each_finished_and_one_usage(
    http: httpx.AsyncClient,
) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 4,
        "n": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    chunks = chunks_of(resp.text)
    assert len({c["id"] for c in chunks}) == 1
    *with_choices, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    finishes: dict[int, list[str | None]] = {0: [], 1: [], 2: []}
    for chunk in with_choices:
        assert chunk["usage"] is None and len(chunk["choices"]) == 1
        choice = chunk["choices"][0]
        if not texts[choice["index"]] and not finishes[choice["index"]]:
            assert choice["delta"]["role"] == "assistant"  # each choice's first delta
        texts[choice["index"]] += choice["delta"].get("content") or ""
        finishes[choice["index"]].append(choice["finish_reason"])
    assert texts == {i: " t0 t1 t2 t3" for i in range(3)}
    for reasons in finishes.values():
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])


async def test_openai_client_reads_n_choices(gateway: Gateway) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="x", max_retries=0)
    async with client:
        whole = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=2,
            n=2,  # type: ignore[arg-type]
        )
        assert [c.message.content for c in whole.choices] == [" t0 t1"] * 2
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=2,
            n=2,
            stream=True,  # type: ignore[arg-type]
        )
        got: dict[int, str] = {}
        async for chunk in stream:
            for choice in chunk.choices:
                got[choice.index] = got.get(choice.index, "") + (choice.delta.content or "")
        assert got == {0: " t0 t1", 1: " t0 t1"}


async def test_text_completion_n_streamed_and_whole(http: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "n": 2}
    whole = await http.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    assert [(c["index"], c["text"]) for c in whole.json()["choices"]] == [
        (0, " t0 t1"),
        (1, " t0 t1"),
    ]
    assert whole.json()["usage"]["completion_tokens"] == 4
    streamed = await http.post("/v1/completions", json={**body, "stream": True})
    texts: dict[int, str] = {}
    for chunk in chunks_of(streamed.text):
        assert chunk["object"] == "text_completion"
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: " t0 t1", 1: " t0 t1"}


@pytest.mark.parametrize(
    ("fields", "headers", "param"),
    [
        ({"n": 9}, {}, "n"),  # over CHARSERVE_MAX_CHOICES (8)
        ({"n": 0}, {}, "n"),
        ({"n": 2}, {"X-Resumable": "true"}, "X-Resumable"),
        ({"n": 2}, {"X-Event-Ids": "true"}, "X-Event-Ids"),
        ({"n": 2}, {"X-Request-Id": "mine-1"}, "X-Request-Id"),
    ],
)
async def test_what_n_cannot_be_combined_with_is_refused_by_name(
    http: httpx.AsyncClient,
    gateway: Gateway,
    fields: dict[str, Any],
    headers: dict[str, str],
    param: str,
) -> None:
    before = len(gateway.engine.started)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **fields}
    resp = await http.post("/v1/chat/completions", json=body, headers=headers)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert len(gateway.engine.started) == before  # nothing was queued


async def test_disconnect_mid_stream_cancels_every_choice(gateway: Gateway) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "n": 3, "stream": True}
    seen: set[int] = set()
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            rid = resp.headers["x-request-id"]
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    seen.update(c["index"] for c in json.loads(line[6:])["choices"])
                    if seen == {0, 1, 2}:  # every choice runs: leave mid-stream
                        break
    ids = [rid, f"{rid}.1", f"{rid}.2"]
    engine = gateway.engine
    await engine.wait_until(lambda: all(i in engine.aborted for i in ids), timeout_s=5)
