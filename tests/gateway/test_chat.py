"""``/v1/chat/completions`` through real uvicorn, Redis and the consumer loop."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from structlog.testing import capture_logs

from tests.gateway.conftest import Gateway
from tests.polling import eventually

MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "system", "content": "You are Bob."}, {"role": "user", "content": "Hi"}]


def sse_events(raw: str) -> list[tuple[str | None, str]]:
    """(id, data) of each SSE event."""
    events = []
    for block in raw.strip().split("\n\n"):
        event_id, data = None, ""
        for line in block.splitlines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                data = line[6:]
        events.append((event_id, data))
    return events


async def test_non_streaming_reply(http: httpx.AsyncClient) -> None:
    resp = await http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3}
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": " t0 t1 t2",
        "refusal": None,
    }
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 3
    assert resp.headers["x-request-id"] and body["id"] == f"chatcmpl-{resp.headers['x-request-id']}"


async def test_client_request_id_is_kept(http: httpx.AsyncClient) -> None:
    """Echoed back, and on the request's log line beside the server's own id."""
    with capture_logs() as logs:
        resp = await http.post(
            "/v1/chat/completions",
            headers={"X-Request-Id": "my-id-123"},
            json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1},
        )

        async def logged() -> bool:
            return any(e["event"] == "request finished" for e in logs)

        await eventually(logged)
    assert resp.headers["x-request-id"] == "my-id-123"
    (line,) = [e for e in logs if e["event"] == "request finished"]
    assert line["client_request_id"] == "my-id-123"
    assert resp.json()["id"] == f"chatcmpl-{line['request_id']}" != "chatcmpl-my-id-123"


@pytest.mark.parametrize("event_ids", [False, True])
async def test_stream_has_openai_shape_and_sequence_ids_when_asked(
    http: httpx.AsyncClient, event_ids: bool
) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"X-Event-Ids": "true"} if event_ids else {}
    resp = await http.post("/v1/chat/completions", json=body, headers=headers)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:] if c["choices"])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(c["usage"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == " t0 t1 t2 t3 t4"
    ids = [int(i) for i, _ in events[:-1] if i is not None]
    if not event_ids:
        assert ids == []  # framed exactly as OpenAI frames it
        return
    assert ids == sorted(ids) and ids[0] == 1 and set(ids) == set(range(1, ids[-1] + 1))


async def test_a_bad_flag_header_is_a_400(http: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "stream": True}
    resp = await http.post("/v1/chat/completions", json=body, headers={"X-Event-Ids": "yes"})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "x-event-ids"


async def test_vllm_benchmark_client_reads_every_stream(gateway: Gateway) -> None:
    """vLLM's own ``vllm bench serve`` request function (it splits events on blank lines
    and strips ``data: ``) consumes the gateway's streams without an error."""
    # A gateway-only install has no vLLM: the client under test is vLLM's own.
    pytest.importorskip("vllm", reason="vLLM's benchmark client is installed with vLLM")
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncInput,
        async_request_openai_chat_completions,
    )

    async with aiohttp.ClientSession() as session:
        outputs = await asyncio.gather(
            *(
                async_request_openai_chat_completions(
                    RequestFuncInput(
                        prompt=f"Hello {n}",
                        api_url=f"{gateway.base_url}/v1/chat/completions",
                        prompt_len=4,
                        output_len=6 + n,
                        model=MODEL,
                        ignore_eos=True,
                    ),
                    session,
                )
                for n in range(8)
            )
        )
    for n, out in enumerate(outputs):
        assert out.success, out.error
        assert out.generated_text == "".join(f" t{i}" for i in range(6 + n))
        assert out.output_tokens == 6 + n and out.ttft > 0


async def test_openai_client_streams_and_collects(gateway: Gateway) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused")
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == " t0 t1 t2 t3"
    assert usage is not None and usage.completion_tokens == 4
    await client.close()


async def test_concurrent_streams_arrive_whole(http: httpx.AsyncClient) -> None:
    async def one(n: int) -> str:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10 + n, "stream": True}
        resp = await http.post("/v1/chat/completions", json=body)
        chunks = [json.loads(d) for _, d in sse_events(resp.text)[:-1]]
        return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)

    texts = await asyncio.gather(*(one(n) for n in range(16)))
    for n, text in enumerate(texts):
        assert text == "".join(f" t{i}" for i in range(10 + n))


def job_id(resp: httpx.Response) -> str:
    """The server's id of a completed request (its completion id without the prefix)."""
    return str(resp.json()["id"]).removeprefix("chatcmpl-")


async def test_sampling_fields_reach_the_engine_and_nothing_else_is_carried(
    http: httpx.AsyncClient, gateway: Gateway
) -> None:
    resp = await http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 1,
            "top_k": 5,
            "temperature": 0.7,
            "stop": "END",
            "user": "end-user-7",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}},
            },
        },
    )
    assert resp.status_code == 200, resp.text
    sampling = gateway.engine.jobs[job_id(resp)].sampling
    assert sampling == {
        "top_k": 5,
        "temperature": 0.7,
        "stop": ["END"],
        "structured_outputs": {"json": {"type": "object"}},
    }


def _bad_requests() -> list[tuple[str, Any, int, str | None, str | None]]:
    """(name, body, status, error code, param)."""
    ok = {"model": MODEL, "messages": MESSAGES}
    long_text = "word " * 2000
    return [
        ("missing messages", {"model": MODEL}, 400, "invalid_value", "messages"),
        ("empty messages", {**ok, "messages": []}, 400, "invalid_value", "messages"),
        ("unknown model", {**ok, "model": "gpt-9"}, 404, "model_not_found", "model"),
        (
            "max_tokens too big",
            {**ok, "max_tokens": 100_000},
            400,
            "context_length_exceeded",
            "max_tokens",
        ),
        (
            "prompt too long",
            {**ok, "messages": [{"role": "user", "content": long_text}]},
            400,
            "context_length_exceeded",
            "messages",
        ),
        (
            "wrong type temperature",
            {**ok, "temperature": "hot"},
            400,
            "invalid_value",
            "temperature",
        ),
        ("wrong type messages", {**ok, "messages": "hi"}, 400, "invalid_value", "messages"),
        (
            "wrong role",
            {**ok, "messages": [{"role": "wizard", "content": "x"}]},
            400,
            "invalid_value",
            "messages.0.role",
        ),
        ("stream not bool", {**ok, "stream": "yes"}, 400, "invalid_value", "stream"),
        ("max_tokens zero", {**ok, "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
        ("n above the bound", {**ok, "n": 9}, 400, "too_many_choices", "n"),
        (
            "bad logit_bias",
            {**ok, "logit_bias": {"abc": 1.0}},
            400,
            "invalid_request",
            "logit_bias",
        ),
        ("body not an object", [1, 2], 400, "invalid_json", None),
        # No field is ignored: an unknown or a refused one is a 400 that names it.
        ("unknown field", {**ok, "mirostat_mode": 2}, 400, "unsupported_field", "mirostat_mode"),
        (
            "tool without a function",
            {**ok, "tools": [{"type": "function"}], "tool_choice": "none"},
            400,
            "invalid_value",
            "tools.0.function",
        ),
        (
            "prompt_logprobs",
            {**ok, "prompt_logprobs": 1},
            400,
            "unsupported_field",
            "prompt_logprobs",
        ),
        ("top_logprobs alone", {**ok, "top_logprobs": 2}, 400, "invalid_value", "top_logprobs"),
        (
            "too many top_logprobs",
            {**ok, "logprobs": True, "top_logprobs": 21},
            400,
            "invalid_value",
            "top_logprobs",
        ),
        ("store", {**ok, "store": True}, 400, "unsupported_field", "store"),
        (
            "message tool_calls",
            {
                **ok,
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": ""},
                            }
                        ],
                    }
                ],
            },
            400,
            "unsupported_field",
            "messages.0.tool_calls",
        ),
        (
            "unknown stream option",
            {**ok, "stream": True, "stream_options": {"include_usage": True, "x": 1}},
            400,
            "invalid_value",
            "stream_options.x",
        ),
        (
            "stream_options without stream",
            {**ok, "stream_options": {"include_usage": True}},
            400,
            "invalid_value",
            "stream_options",
        ),
        (
            "two constraints",
            {**ok, "guided_regex": "a+", "response_format": {"type": "json_object"}},
            400,
            "invalid_value",
            "response_format",
        ),
        (
            "json_schema without schema",
            {**ok, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            400,
            "invalid_value",
            "response_format",
        ),
        (
            "continue a user message",
            {**ok, "add_generation_prompt": False, "continue_final_message": True},
            400,
            "invalid_value",
            "continue_final_message",
        ),
        (
            "template kwarg overwrites an input",
            {**ok, "chat_template_kwargs": {"messages": "x"}},
            400,
            "invalid_request",
            "chat_template_kwargs.messages",
        ),
    ]


@pytest.mark.parametrize("case", _bad_requests(), ids=lambda c: c[0])
async def test_bad_input_is_refused_before_queueing(
    http: httpx.AsyncClient, gateway: Gateway, case: tuple[str, Any, int, str | None, str | None]
) -> None:
    _, body, status, code, param = case
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == code and error["param"] == param
    assert resp.headers["x-request-id"] not in gateway.engine.started


async def test_malformed_json_is_a_400(http: httpx.AsyncClient) -> None:
    resp = await http.post(
        "/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("headers", [{"X-Priority": "urgent"}, {"X-Latency-Budget-Ms": "soon"}])
async def test_bad_admission_headers_are_a_400(
    http: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    resp = await http.post(
        "/v1/chat/completions", headers=headers, json={"model": MODEL, "messages": MESSAGES}
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == next(iter(headers))


async def test_deadline_reaches_the_engine_as_priority(
    http: httpx.AsyncClient, gateway: Gateway
) -> None:
    ids = {}
    for name, budget in (("fast", "100"), ("slow", "100000")):
        resp = await http.post(
            "/v1/chat/completions",
            headers={"X-Latency-Budget-Ms": budget},
            json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1},
        )
        assert resp.status_code == 200
        ids[name] = job_id(resp)
    prio = gateway.engine.priorities
    assert prio[ids["fast"]] < prio[ids["slow"]]
    job = gateway.engine.jobs[ids["slow"]]
    assert job.deadline_ms - job.arrival_ms == 100_000 and job.priority_class == "interactive"


async def test_disconnect_mid_stream_aborts_the_engine_request(gateway: Gateway) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "stream": True}
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    walked = json.loads(line[6:])["id"].removeprefix("chatcmpl-")
                    break
    await gateway.engine.wait_until(lambda: walked in gateway.engine.aborted, timeout_s=5)


async def test_disconnect_while_the_reply_pauses_aborts_it(gateway: Gateway) -> None:
    # The engine stops after the first token, so nothing is written that could fail: only
    # the reply's watch on the connection can see the client leave.
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "stream": True}
    try:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as client:
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        paused = json.loads(line[6:])["id"].removeprefix("chatcmpl-")
                        gateway.engine.release.clear()
                        break
        await gateway.engine.wait_until(lambda: paused in gateway.engine.aborted, timeout_s=5)
    finally:
        gateway.engine.release.set()


async def test_worker_error_before_first_token_gets_a_status(
    http: httpx.AsyncClient, gateway: Gateway
) -> None:
    # Hold every batch slot so the next request must wait in the queue past its deadline.
    gateway.engine.release.clear()
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    blockers = [asyncio.create_task(http.post("/v1/chat/completions", json=body)) for _ in range(8)]
    await gateway.engine.wait_until(lambda: gateway.engine.running == 8)
    # A budget admission can grant (the slots drain fast), which the held engine misses:
    # admission reads busy slots from the live leases now, and refuses a budget it can
    # already see is too short (60 ms here was a door refusal, not an expiry).
    late = asyncio.create_task(
        http.post("/v1/chat/completions", headers={"X-Latency-Budget-Ms": "1000"}, json=body)
    )
    await asyncio.sleep(1.5)  # well past the 1 s budget while it waits
    gateway.engine.release.set()
    resp = await late
    assert all(r.status_code == 200 for r in await asyncio.gather(*blockers))
    assert resp.status_code == 429, resp.text
    assert resp.json()["error"]["code"] == "expired"
    assert resp.headers["retry-after"] and resp.headers["x-charserve-drop-reason"] == "expired"
    assert resp.headers["x-request-id"] not in gateway.engine.started


async def test_models_health_ready_and_unknown_routes(http: httpx.AsyncClient) -> None:
    models = (await http.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert (await http.get("/health")).status_code == 200
    ready = await http.get("/ready")
    assert ready.status_code == 200 and ready.json()["workers"] >= 1
    missing = await http.get("/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    assert missing.headers["x-request-id"]


async def test_echo_puts_the_last_assistant_message_in_front(http: httpx.AsyncClient) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "Well,"}]
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 2,
        "echo": True,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    whole = await http.post("/v1/chat/completions", json=body)
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["message"]["content"] == "Well, t0 t1"
    streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [json.loads(d) for _, d in sse_events(streamed.text)[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Well, t0"}
    # The last message is the user's: nothing of the reply's role to echo.
    plain = await http.post(
        "/v1/chat/completions",
        json={
            **body,
            "messages": MESSAGES,
            "add_generation_prompt": True,
            "continue_final_message": False,
        },
    )
    assert plain.json()["choices"][0]["message"]["content"] == " t0 t1"
