"""Every request field honoured or refused: neutral values of refused fields are served,
the template options and a speaker's name reach the prompt, usage can come with every
chunk, and the token routes count what admission counts."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from gateway.chat.prompts import PromptBuilder
from tests.gateway.conftest import Gateway
from tests.gateway.test_chat import MESSAGES, MODEL, job_id, sse_events
from tests.polling import eventually


@pytest.fixture(autouse=True)
async def ready(http: httpx.AsyncClient) -> None:
    """The module's gateway has seen its worker."""

    async def is_ready() -> bool:
        return (await http.get("/ready")).status_code == 200

    await eventually(is_ready, timeout_s=10)


async def _prompt(http: httpx.AsyncClient, gateway: Gateway, **fields: Any) -> list[int]:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, **fields}
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return gateway.engine.jobs[job_id(resp)].prompt_token_ids


async def test_neutral_values_of_refused_fields_are_served(
    http: httpx.AsyncClient, gateway: Gateway
) -> None:
    plain = await _prompt(http, gateway)
    neutral = await _prompt(
        http,
        gateway,
        logprobs=False,
        n=1,
        tools=[],
        tool_choice="none",
        store=False,
        parallel_tool_calls=True,
        service_tier="auto",
        echo=None,
    )
    assert neutral == plain


async def test_template_options_and_names_reach_the_prompt(
    http: httpx.AsyncClient, gateway: Gateway, model_path: str
) -> None:
    prompts = PromptBuilder(model_path, 512, 16)
    plain = await _prompt(http, gateway)
    without_generation = await _prompt(http, gateway, add_generation_prompt=False)
    assert plain[: len(without_generation)] == without_generation
    assert len(without_generation) < len(plain)
    partial = [*MESSAGES, {"role": "assistant", "content": "Well, I"}]
    continued = await _prompt(
        http,
        gateway,
        messages=partial,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert prompts.decode(continued).endswith("Well, I")  # no end-of-turn after it
    named = [MESSAGES[0], {"role": "user", "content": "Hi", "name": "Alice"}]
    text = prompts.decode(await _prompt(http, gateway, messages=named))
    assert "Alice: Hi" in text  # this template has no name: the name leads the content


async def test_continuous_usage_stats_put_usage_on_every_chunk(http: httpx.AsyncClient) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200
    chunks = [json.loads(d) for _, d in sse_events(resp.text)[:-1]]
    counted = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counted == sorted(counted) and counted[-1] == 4
    assert all(c["usage"]["prompt_tokens"] > 0 for c in chunks)


async def test_tokenize_counts_what_admission_counts(
    http: httpx.AsyncClient, gateway: Gateway
) -> None:
    resp = await http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES})
    assert resp.status_code == 200, resp.text
    counted = resp.json()
    assert counted["tokens"] == await _prompt(http, gateway)
    assert counted["count"] == len(counted["tokens"]) and counted["max_model_len"] == 512
    text = await http.post("/tokenize", json={"prompt": "Hello there", "return_token_strs": True})
    tokens = text.json()["tokens"]
    assert len(text.json()["token_strs"]) == len(tokens)
    back = await http.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert back.json() == {"prompt": "Hello there"}
    bad = await http.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = await http.post("/tokenize", json={"prompt": "x", "messages": MESSAGES})
    assert both.status_code == 400
    other = await http.post("/tokenize", json={"model": "gpt-9", "prompt": "x"})
    assert other.status_code == 404


async def test_model_route(http: httpx.AsyncClient) -> None:
    card = await http.get(f"/v1/models/{MODEL}")
    assert card.status_code == 200 and card.json()["max_model_len"] == 512
    assert (await http.get("/v1/models/gpt-9")).status_code == 404


async def test_logprobs_streamed_and_whole_in_openai_shapes(http: httpx.AsyncClient) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = (await http.post("/v1/chat/completions", json=body)).json()
    content = whole["choices"][0]["logprobs"]["content"]
    # The test engine: each token at -0.5, itself the best of its alternatives.
    assert [c["token"] for c in content] == [" t0", " t1", " t2"]
    assert all(c["logprob"] == -0.5 and c["bytes"] == list(c["token"].encode()) for c in content)
    assert [len(c["top_logprobs"]) for c in content] == [2, 2, 2]
    assert content[0]["top_logprobs"][0] == {
        "token": " t0",
        "logprob": -0.5,
        "bytes": [32, 116, 48],
    }
    streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [json.loads(d) for _, d in sse_events(streamed.text)[:-1]]
    tokens = [
        c["token"]
        for chunk in chunks
        if chunk["choices"] and chunk["choices"][0]["logprobs"]
        for c in chunk["choices"][0]["logprobs"]["content"]
    ]
    assert tokens == [" t0", " t1", " t2"]
    text = await http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "logprobs": 1}
    )
    legacy = text.json()["choices"][0]["logprobs"]
    assert legacy["tokens"] == [" t0", " t1", " t2"]
    assert legacy["token_logprobs"] == [-0.5] * 3 and legacy["text_offset"] == [0, 3, 6]
    assert legacy["top_logprobs"] == [{" t0": -0.5}, {" t1": -0.5}, {" t2": -0.5}]


async def test_tokenize_is_bounded_as_a_chat_is(http: httpx.AsyncClient, gateway: Gateway) -> None:
    many = [{"role": "user", "content": "x"}] * (gateway.settings.max_messages + 1)
    resp = await http.post("/tokenize", json={"messages": many})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    huge = await http.post("/tokenize", json={"prompt": "x" * 10_000_000})
    assert huge.status_code in (400, 413)
