"""Tool calling: the reply shaping (pure), and the route through real uvicorn, Redis and
the consumer loop with the test engine (whose replies are never JSON: the real engine's
structured outputs are tested in tests/e2e)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from gateway.chat.tools import NamedToolChoice, Tool, constraint
from gateway.streaming.tool_calls import ToolMode, ToolStream, shape_whole
from tests.gateway.conftest import Gateway
from tests.gateway.test_chat import MESSAGES, MODEL, sse_events

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def stream_all(mode: ToolMode, pieces: list[str], finish: str = "stop") -> tuple[str, Any, str]:
    """Feed ``pieces`` through a ToolStream: (content, tool calls merged, finish)."""
    stream = ToolStream(mode, "chatcmpl-x", 0)
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    more, reason = stream.end(finish)
    deltas += more
    content = "".join(d.get("content") or "" for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            into = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            into["id"] = call.get("id", into.get("id"))
            into["name"] += call.get("function", {}).get("name", "")
            into["arguments"] += call["function"].get("arguments", "")
    return content, calls, reason


def test_required_schema_is_vllms_array_of_named_parameters() -> None:
    tools = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]
    schema = constraint(tools, "required", None)
    assert schema is not None and schema["type"] == "array" and schema["minItems"] == 1
    names = [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert constraint(tools, "required", False)["maxItems"] == 1  # type: ignore[index]
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})
    assert constraint(tools, named, None) == {"type": "object", "properties": {}}
    assert constraint(tools, "auto", None) is None and constraint(tools, "none", None) is None


def test_whole_replies_become_calls_or_stay_content() -> None:
    required = ToolMode("required")
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    content, calls, finish = shape_whole(required, text, "stop", "chatcmpl-x", 0)
    assert content is None and finish == "tool_calls" and calls is not None
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert calls[0]["id"].startswith("call_")
    # Cut off by max_tokens: nothing parses, so nothing is dropped: the text is content.
    assert shape_whole(required, text[:20], "length", "chatcmpl-x", 0) == (
        text[:20],
        None,
        "length",
    )
    named = ToolMode("named", name="get_weather")
    _, calls, finish = shape_whole(named, '{"city": "Oslo"}', "stop", "chatcmpl-x", 0)
    assert calls is not None and calls[0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert finish == "stop"
    auto = ToolMode("auto", parser="hermes")
    said = 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    content, calls, finish = shape_whole(auto, said, "stop", "chatcmpl-x", 0)
    assert content == "Let me look." and finish == "tool_calls"
    assert calls is not None and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert shape_whole(auto, "Just words.", "stop", "chatcmpl-x", 0) == (
        "Just words.",
        None,
        "stop",
    )


def test_ids_are_stable_per_completion_choice_and_position() -> None:
    mode = ToolMode("named", name="f")
    first = shape_whole(mode, "{}", "stop", "chatcmpl-a", 0)[1]
    again = shape_whole(mode, "{}", "stop", "chatcmpl-a", 0)[1]
    other = shape_whole(mode, "{}", "stop", "chatcmpl-a", 1)[1]
    assert first == again and first is not None and other is not None
    assert first[0]["id"] != other[0]["id"]


@pytest.mark.parametrize("cut", [1, 3, 7, 11])
def test_streamed_auto_holds_back_only_a_possible_tag(cut: int) -> None:
    said = 'Let me look. <tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    pieces = [said[i : i + cut] for i in range(0, len(said), cut)]
    content, calls, finish = stream_all(ToolMode("auto", parser="hermes"), pieces)
    assert content == "Let me look. " and finish == "tool_calls"
    assert calls[0]["name"] == "get_time" and json.loads(calls[0]["arguments"]) == {"tz": "UTC"}
    # A '<' that turns out not to start the tag is sent on, not dropped.
    content, calls, finish = stream_all(ToolMode("auto", parser="hermes"), ["a <", "b> c", " <to"])
    assert (content, calls, finish) == ("a <b> c <to", {}, "stop")


def test_streamed_named_sends_arguments_as_they_come() -> None:
    mode = ToolMode("named", name="get_weather")
    stream = ToolStream(mode, "chatcmpl-x", 0)
    head = stream.feed('{"city"')
    assert head[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert stream.feed(': "Oslo"}') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]}
    ]
    assert stream.end("stop") == ([], "stop")
    content, calls, finish = stream_all(
        ToolMode("required"), ['[{"name": "get_time", ', '"parameters": {}}]']
    )
    assert content == "" and finish == "tool_calls" and calls[0]["arguments"] == "{}"


# -- the route --------------------------------------------------------------------------


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, **fields}


async def test_named_choice_constrains_the_job_and_replies_with_a_call(
    http: httpx.AsyncClient, gateway: Gateway
) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    resp = await http.post("/v1/chat/completions", json=chat(tools=[WEATHER], tool_choice=named))
    assert resp.status_code == 200, resp.text
    job = gateway.engine.jobs[resp.headers["x-request-id"]]
    assert job.sampling["structured_outputs"] == {"json": WEATHER["function"]["parameters"]}
    message = resp.json()["choices"][0]["message"]
    assert message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == " t0 t1 t2"  # the test engine's text, as is
    streamed = await http.post(
        "/v1/chat/completions", json=chat(tools=[WEATHER], tool_choice=named, stream=True)
    )
    chunks = [json.loads(d) for _, d in sse_events(streamed.text)[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    args = "".join(
        call["function"].get("arguments", "") for d in deltas for call in d.get("tool_calls", [])
    )
    assert args == " t0 t1 t2"


async def test_required_reply_that_does_not_parse_is_content(
    http: httpx.AsyncClient, gateway: Gateway
) -> None:
    resp = await http.post(
        "/v1/chat/completions", json=chat(tools=[WEATHER, TIME], tool_choice="required")
    )
    assert resp.status_code == 200, resp.text
    schema = gateway.engine.jobs[resp.headers["x-request-id"]].sampling["structured_outputs"]
    assert schema["json"]["type"] == "array"
    choice = resp.json()["choices"][0]
    assert choice["message"]["content"] == " t0 t1 t2" and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length"


async def test_a_tool_conversation_reaches_the_template(
    http: httpx.AsyncClient, gateway: Gateway
) -> None:
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    resp = await http.post(
        "/v1/chat/completions", json=chat(messages=messages, tools=[WEATHER], tool_choice="none")
    )
    assert resp.status_code == 200, resp.text
    assert "structured_outputs" not in gateway.engine.jobs[resp.headers["x-request-id"]].sampling
    detok = await http.post(
        "/detokenize",
        json={
            "model": MODEL,
            "tokens": gateway.engine.jobs[resp.headers["x-request-id"]].prompt_token_ids,
        },
    )
    assert "Sunny, 21 C" in detok.json()["prompt"]


@pytest.mark.parametrize(
    ("fields", "headers", "param"),
    [
        ({"tools": [WEATHER]}, {}, "tool_choice"),  # auto (the default): no parser here
        ({"tools": [WEATHER], "tool_choice": "auto"}, {}, "tool_choice"),
        ({"tool_choice": "required"}, {}, "tool_choice"),  # no tools
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            {},
            "tool_choice",
        ),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, {}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "logprobs": True}, {}, "logprobs"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            {},
            "response_format",
        ),
        ({"tools": [WEATHER], "tool_choice": "required"}, {"X-Resumable": "true"}, "X-Resumable"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, {}, "tools"),
        ({"tools": [WEATHER] * 65, "tool_choice": "none"}, {}, "tools"),
        ({"functions": [WEATHER["function"]]}, {}, "functions"),
        ({"tool_parser": "hermes"}, {}, "tool_parser"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "call_1"}]},
            {},
            "messages.0.tool_call_id",
        ),
    ],
)
async def test_what_tools_cannot_serve_is_refused_by_name(
    http: httpx.AsyncClient,
    gateway: Gateway,
    fields: dict[str, Any],
    headers: dict[str, str],
    param: str,
) -> None:
    before = len(gateway.engine.started)
    resp = await http.post("/v1/chat/completions", json=chat(**fields), headers=headers)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].startswith(param), resp.json()
    assert len(gateway.engine.started) == before
