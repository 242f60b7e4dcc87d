"""``POST /v1/completions``: a prompt continued as is, through the same admission, queue,
relay and resume as a chat, framed as OpenAI frames text completions."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from gateway.chat.prompts import PromptBuilder
from tests.gateway.conftest import Gateway
from tests.gateway.test_chat import MODEL, sse_events
from tests.polling import eventually


@pytest.fixture(autouse=True)
async def ready(http: httpx.AsyncClient) -> None:
    async def is_ready() -> bool:
        return (await http.get("/ready")).status_code == 200

    await eventually(is_ready, timeout_s=10)


async def test_whole_completion_of_a_text_prompt(
    http: httpx.AsyncClient, gateway: Gateway, model_path: str
) -> None:
    prompt = "Captain Mira Vance looked at the stars and said"
    resp = await http.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3}
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    [choice] = body["choices"]
    assert choice["text"] == " t0 t1 t2" and choice["finish_reason"] == "length"
    job = gateway.engine.jobs[body["id"].removeprefix("cmpl-")]
    # No chat template: the prompt's own tokens (with the tokenizer's special tokens).
    expected = PromptBuilder(model_path, 512, 16).encode_text(prompt)
    assert job.prompt_token_ids == expected
    assert body["usage"]["prompt_tokens"] == len(expected)


async def test_token_id_prompt_and_default_length(
    http: httpx.AsyncClient, gateway: Gateway
) -> None:
    resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3]})
    assert resp.status_code == 200, resp.text
    job = gateway.engine.jobs[resp.json()["id"].removeprefix("cmpl-")]
    assert job.prompt_token_ids == [1, 2, 3] and job.max_tokens == 16  # OpenAI's default


async def test_streamed_completion_is_framed_as_openai_frames_it(
    http: httpx.AsyncClient,
) -> None:
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = await http.post("/v1/completions", json=body)
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert events[-1] == (None, "[DONE]") and all(i is None for i, _ in events)
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == " t0 t1 t2 t3"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


async def test_the_openai_client_reads_completions(gateway: Gateway) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="x")
    whole = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert whole.choices[0].text == " t0 t1"
    stream = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True)
    parts = [c.choices[0].text async for c in stream if c.choices]
    assert "".join(parts) == " t0 t1 t2"
    await client.close()


async def test_a_resumable_completion_resumes_as_a_completion(http: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}
    first = await http.post("/v1/completions", json=body, headers={"X-Resumable": "true"})
    completion_id = json.loads(sse_events(first.text)[0][1])["id"]
    again = await http.get(f"/v1/chat/completions/{completion_id}/events")
    assert again.status_code == 200
    chunks = [json.loads(d) for _, d in sse_events(again.text)[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " t0 t1 t2"


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
        ({"prompt": "x", "logprobs": 6}, 400, "logprobs"),
        ({"prompt": "x", "messages": []}, 400, "messages"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": [10**9]}, 400, "prompt"),
        ({"prompt": "x", "max_tokens": 100_000}, 400, "max_tokens"),
        ({"prompt": "x", "n": 9}, 400, "n"),
        ({"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ],
)
async def test_refusals_name_the_field(
    http: httpx.AsyncClient, fields: dict[str, object], status: int, param: str
) -> None:
    resp = await http.post("/v1/completions", json={"model": MODEL, **fields})
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param


async def test_streamed_logprobs_offsets_count_from_the_completions_start(
    http: httpx.AsyncClient,
) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "logprobs": 1, "stream": True}
    resp = await http.post("/v1/completions", json=body)
    chunks = [json.loads(d) for _, d in sse_events(resp.text)[:-1]]
    offsets = [
        o
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for o in c["choices"][0]["logprobs"]["text_offset"]
    ]
    assert offsets == [0, 3, 6]  # " t0", " t1", " t2"


async def test_echo_puts_the_prompt_in_front_streamed_and_whole(http: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": "Hi there", "max_tokens": 2, "echo": True}
    whole = await http.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["text"] == "Hi there t0 t1"
    assert whole.json()["usage"]["completion_tokens"] == 2
    streamed = await http.post("/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(d) for _, d in sse_events(streamed.text)[:-1]]
    assert chunks[0]["choices"][0]["text"].startswith("Hi there")
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hi there t0 t1"
    # Token ids are echoed as their text.
    ids = (await http.post("/tokenize", json={"model": MODEL, "prompt": "Hi there"})).json()
    by_ids = await http.post(
        "/v1/completions", json={**body, "prompt": ids["tokens"], "add_special_tokens": False}
    )
    assert by_ids.json()["choices"][0]["text"].endswith("Hi there t0 t1")
