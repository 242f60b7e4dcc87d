"""End to end with the real engine: the official ``openai`` client against the gateway,
Redis, Ray Serve and vLLM's CPU engine with the bundled model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import Chunk
from cluster.wire.replylog import read_reply_log
from tests.e2e.conftest import Stack
from tests.polling import eventually

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
PERSONA = "You are Captain Mira Vance, captain of the starship Wayfarer. Always stay in character."
PERSONA_WORDS = ("mira", "vance", "wayfarer")


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    yield c
    await c.close()


async def _stream_text(
    client: openai.AsyncOpenAI, messages: list[dict[str, str]], **kw: object
) -> tuple[str, int, str | None]:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        stream=True,
        temperature=0,
        **kw,  # type: ignore[arg-type]
    )
    parts: list[str] = []
    finish = None
    async for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), len(parts), finish


async def test_streamed_reply_in_character(client: openai.AsyncOpenAI) -> None:
    question = {"role": "user", "content": "Introduce yourself."}
    text, pieces, finish = await _stream_text(
        client, [{"role": "system", "content": PERSONA}, question], max_tokens=40
    )
    assert pieces > 3 and finish in ("stop", "length")
    assert any(w in text.lower() for w in PERSONA_WORDS), text
    # Control: without the persona the model does not invent this character.
    plain, _, _ = await _stream_text(client, [question], max_tokens=40)
    assert not any(w in plain.lower() for w in PERSONA_WORDS), plain


async def test_non_streamed_reply(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model=MODEL,
        max_tokens=16,
        temperature=0,
        messages=[{"role": "system", "content": PERSONA}, {"role": "user", "content": "Hello!"}],
    )
    assert reply.object == "chat.completion"
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 16
    assert reply.usage.prompt_tokens > 20  # the persona is in the prompt


async def test_stream_options_include_usage(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Count to ten."}],
        extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"


async def test_eight_concurrent_streams_arrive_whole_and_in_order(stack: Stack) -> None:
    async def one(
        http: httpx.AsyncClient, n: int
    ) -> tuple[str, list[int], str, dict[str, int], str]:
        body = {
            "model": MODEL,
            "max_tokens": 24,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Tell me story number {n}."}],
        }
        ids: list[int] = []
        parts: list[str] = []
        usage: dict[str, int] = {}
        last = ""
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            request_id = resp.headers["x-request-id"]
            async for line in resp.aiter_lines():
                if line.startswith("id: "):
                    ids.append(int(line[4:]))
                elif line.startswith("data: "):
                    last = line[6:]
                    if last == "[DONE]":
                        continue
                    event = json.loads(last)
                    if event["choices"]:
                        parts.append(event["choices"][0]["delta"].get("content", ""))
                    if event.get("usage"):
                        usage = event["usage"]
        return request_id, ids, "".join(parts), usage, last

    redis = aioredis.Redis.from_url(stack.redis_url)
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as http:
            results = await asyncio.gather(*(one(http, n) for n in range(8)))
        for request_id, ids, text, usage, last in results:
            assert last == "[DONE]" and usage["completion_tokens"] == 24
            assert ids == sorted(ids)  # in order
            # Whole: exactly what the worker generated, as recorded in the request's log.
            logged = [
                protocol.decode_as(fields[b"c"], Chunk)
                for _, fields in await redis.xrange(Keys().reply_log(request_id))
            ]
            assert [c.seq for c in logged] == list(range(1, len(logged) + 1))
            assert logged[-1].is_final and logged[-1].completion_tokens == 24
            assert text == "".join(c.text for c in logged) and text
    finally:
        await redis.aclose()


async def test_bad_inputs_are_refused_before_queueing(stack: Stack) -> None:
    redis = aioredis.Redis.from_url(stack.redis_url)
    keys = Keys()
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        (b'{"model": "x", ', 400),
        (json.dumps({"model": MODEL}).encode(), 400),
        (json.dumps({**ok, "model": "nope"}).encode(), 404),
        (json.dumps({**ok, "max_tokens": 5000}).encode(), 400),
        (
            json.dumps({**ok, "messages": [{"role": "user", "content": "story " * 3000}]}).encode(),
            400,
        ),
        (json.dumps({**ok, "temperature": [1]}).encode(), 400),
    ]
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as http:
            for body, status in cases:
                resp = await http.post(
                    "/v1/chat/completions",
                    content=body,
                    headers={"content-type": "application/json"},
                )
                assert resp.status_code == status, resp.text
                error = resp.json()["error"]
                assert error["message"] and error["type"] == "invalid_request_error"
                # Nothing reached a worker: no reply log exists for this request.
                assert not await redis.exists(keys.reply_log(resp.headers["x-request-id"]))
    finally:
        await redis.aclose()


async def test_openai_client_raises_typed_errors(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(
            model="gpt-nope", messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=MODEL, max_tokens=10_000, messages=[{"role": "user", "content": "x"}]
        )
    assert info.value.code == "context_length_exceeded"


async def test_ready_and_models(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url) as http:
        assert (await http.get("/ready")).json()["workers"] == 1
        models = (await http.get("/v1/models")).json()["data"]
        assert models[0]["id"] == MODEL and models[0]["max_model_len"] == 2048


async def test_disconnect_aborts_the_engine_request(stack: Stack) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 1500,
        "stream": True,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Write a very long saga."}],
    }
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            request_id = resp.headers["x-request-id"]
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    break  # first token seen: walk away
    redis = aioredis.Redis.from_url(stack.redis_url)
    keys = Keys()

    async def ended() -> bool:
        chunks = await read_reply_log(redis, keys, request_id)
        return bool(chunks) and chunks[-1].is_final

    try:
        await eventually(ended, timeout_s=30)
        final = (await read_reply_log(redis, keys, request_id))[-1]
    finally:
        await redis.aclose()
    # The worker aborted the vLLM request: it ended as cancelled, long before 1500 tokens.
    assert final.error_code == "cancelled"
    assert final.completion_tokens < 200


async def test_json_schema_reply_validates_on_the_real_engine(
    client: openai.AsyncOpenAI,
) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    reply = await client.chat.completions.create(
        model=MODEL,
        max_tokens=48,
        temperature=0,
        messages=[{"role": "user", "content": "Describe a pirate captain as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "captain", "schema": schema},
        },
    )
    data = json.loads(reply.choices[0].message.content or "")
    assert set(data) == {"name", "age"}
    assert isinstance(data["name"], str) and isinstance(data["age"], int)
    choice = await client.chat.completions.create(
        model=MODEL,
        max_tokens=8,
        messages=[{"role": "user", "content": "Pick a side."}],
        extra_body={"structured_outputs": {"choice": ["port", "starboard"]}},
    )
    assert choice.choices[0].message.content in ("port", "starboard")


async def test_seed_is_refused_on_the_cpu_engine_with_the_reason(
    client: openai.AsyncOpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=MODEL, max_tokens=4, seed=7, messages=[{"role": "user", "content": "x"}]
        )
    assert "seed" in info.value.message and "CPU" in info.value.message


async def test_logprobs_on_the_real_engine_are_the_greedy_choice(
    client: openai.AsyncOpenAI,
) -> None:
    reply = await client.chat.completions.create(
        model=MODEL,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        messages=[{"role": "user", "content": "Name a star."}],
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(t.token for t in content) == choice.message.content
    for token in content:
        # Greedy: every token is its step's best alternative, with that alternative's logprob.
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob)
        assert token.logprob <= 0.0
    stream = await client.completions.create(
        model=MODEL, prompt="The captain said", max_tokens=6, temperature=0, logprobs=2, stream=True
    )
    tokens = [
        t
        async for c in stream
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert len(tokens) == 6


async def test_n_choices_on_the_real_engine(client: openai.AsyncOpenAI) -> None:
    messages = [{"role": "system", "content": PERSONA}, {"role": "user", "content": "Hello!"}]
    whole = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=1.0,
        n=3,  # type: ignore[arg-type]
    )
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.message.content for c in whole.choices)
    assert whole.usage is not None and 3 <= whole.usage.completion_tokens <= 3 * 12
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts: dict[int, str] = {}
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert sorted(texts) == [0, 1, 2] and all(texts.values())
    assert usage is not None and usage.completion_tokens == 3 * 8


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


async def test_tool_calls_on_the_real_engine(client: openai.AsyncOpenAI) -> None:
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    required = await client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=60,
        temperature=0,
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice="required",
    )
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    # Named, streamed: the arguments arrive in pieces and parse whole.
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=60,
        temperature=0,
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream=True,
    )
    pieces, names = [], set()
    async for chunk in stream:
        for call_delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if call_delta.function and call_delta.function.name:
                names.add(call_delta.function.name)
            if call_delta.function and call_delta.function.arguments:
                pieces.append(call_delta.function.arguments)
    assert names == {"get_weather"} and len(pieces) > 1
    assert set(json.loads("".join(pieces))) == {"city"}
