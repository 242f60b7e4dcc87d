"""Session actions through the real gateway: swipe (the same prompt, alternatives kept and
selectable), continue (the last reply extended), impersonate (nothing recorded), message
edits and deletions, branches, and the refusals of each."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from cluster.wire.keys import Keys
from gateway.characters.persona_chat import IMPERSONATE_PROMPT
from tests.fakes import FakeEngine
from tests.gateway.conftest import Gateway, gateway_settings, serve_gateway
from tests.gateway.test_characters import MODEL, V2_CARD
from workers.loop.config import ConsumerConfig
from workers.loop.consumer import Consumer


@pytest.fixture(scope="module")
async def gw(redis_url: str, model_path: str) -> AsyncIterator[Gateway]:
    """A gateway with one fake worker."""
    settings = gateway_settings(redis_url, model_path, max_model_len=1024, heartbeat_ms=1000)
    keys = Keys(settings.namespace)
    engine = FakeEngine(max_slots=8, delay_s=0.001)
    consumer = Consumer(redis_url, keys, engine, ConsumerConfig(heartbeat_ms=100), worker_id="w")
    await consumer.start()
    async with serve_gateway(settings) as base_url:
        yield Gateway(base_url, engine, keys, settings)
    await consumer.close()


@pytest.fixture
async def client(gw: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gw.base_url, timeout=30) as http:
        yield http


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Any:
    return AutoTokenizer.from_pretrained(model_path)


async def _session(client: httpx.AsyncClient) -> str:
    character = (await client.post("/v1/characters", json=V2_CARD)).json()
    resp = await client.post(
        "/v1/sessions", json={"character_id": character["id"], "user_name": "Ada"}
    )
    assert resp.status_code == 200, resp.text
    return str(resp.json()["id"])


async def _turn(client: httpx.AsyncClient, session_id: str, text: str) -> httpx.Response:
    resp = await client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "session_id": session_id,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 3,
        },
    )
    assert resp.status_code == 200, resp.text
    return resp


async def _messages(client: httpx.AsyncClient, session_id: str) -> list[dict[str, Any]]:
    resp = await client.get(f"/v1/sessions/{session_id}")
    assert resp.status_code == 200, resp.text
    return list(resp.json()["messages"])


def _prompt(gw: Gateway, resp: httpx.Response) -> list[int]:
    return list(gw.engine.jobs[resp.headers["x-request-id"]].prompt_token_ids)


async def test_a_swipe_asks_the_same_prompt_and_keeps_the_alternatives(
    client: httpx.AsyncClient, gw: Gateway, tokenizer: Any
) -> None:
    sid = await _session(client)
    first = await _turn(client, sid, "Tell me about the Kestrel.")
    swipe = await client.post(f"/v1/sessions/{sid}/swipe", json={"max_tokens": 5})
    assert swipe.status_code == 200, swipe.text
    assert swipe.json()["choices"][0]["message"]["content"] == " t0 t1 t2 t3 t4"
    assert _prompt(gw, swipe) == _prompt(gw, first)
    last = (await _messages(client, sid))[-1]
    assert last == {
        "role": "assistant",
        "content": " t0 t1 t2 t3 t4",
        "swipes": [" t0 t1 t2", " t0 t1 t2 t3 t4"],
        "swipe_id": 1,
    }
    # Streamed, the same; then the first alternative chosen again.
    async with client.stream(
        "POST", f"/v1/sessions/{sid}/swipe", json={"max_tokens": 2, "stream": True}
    ) as resp:
        assert resp.status_code == 200
        assert [line async for line in resp.aiter_lines()][-2:] == ["data: [DONE]", ""]
    chosen = await client.patch(f"/v1/sessions/{sid}/messages/2", json={"swipe_id": 0})
    assert chosen.status_code == 200, chosen.text
    assert chosen.json()["content"] == " t0 t1 t2"
    assert chosen.json()["swipes"] == [" t0 t1 t2", " t0 t1 t2 t3 t4", " t0 t1"]
    # The next turn answers the chosen alternative.
    after = await _turn(client, sid, "And then?")
    text = tokenizer.decode(_prompt(gw, after))
    assert "assistant\n t0 t1 t2<|im_end|>" in text and " t3" not in text


async def test_continue_extends_the_last_reply_in_place(
    client: httpx.AsyncClient, gw: Gateway, tokenizer: Any
) -> None:
    sid = await _session(client)
    await _turn(client, sid, "Hello")
    more = await client.post(f"/v1/sessions/{sid}/continue", json={"max_tokens": 2})
    assert more.status_code == 200, more.text
    text = tokenizer.decode(_prompt(gw, more))
    # The reply is continued, not closed and followed by a new assistant turn.
    assert text.endswith(" t0 t1 t2"), text[-80:]
    messages = await _messages(client, sid)
    assert len(messages) == 3 and messages[-1]["content"] == " t0 t1 t2 t0 t1"


async def test_impersonate_writes_the_users_line_and_records_nothing(
    client: httpx.AsyncClient, gw: Gateway, tokenizer: Any
) -> None:
    sid = await _session(client)
    await _turn(client, sid, "Hello")
    before = await _messages(client, sid)
    line = await client.post(f"/v1/sessions/{sid}/impersonate", json={"max_tokens": 2})
    assert line.status_code == 200, line.text
    text = tokenizer.decode(_prompt(gw, line))
    assert IMPERSONATE_PROMPT.replace("{{user}}", "Ada").replace("{{char}}", "Captain Mira") in text
    assert await _messages(client, sid) == before


async def test_edit_delete_and_branch(client: httpx.AsyncClient, gw: Gateway) -> None:
    sid = await _session(client)
    await _turn(client, sid, "one")
    await _turn(client, sid, "two")
    edited = await client.patch(f"/v1/sessions/{sid}/messages/1", json={"content": "uno"})
    assert edited.json() == {"role": "user", "content": "uno"}
    branch = await client.post(f"/v1/sessions/{sid}/branch", json={"at": 3})
    assert branch.status_code == 200, branch.text
    bid = branch.json()["id"]
    assert bid != sid
    original = await _messages(client, sid)
    assert branch.json()["messages"] == original[:3]
    # The branch goes its own way; the original is untouched, and vice versa.
    await _turn(client, bid, "elsewhere")
    assert await _messages(client, sid) == original
    deleted = await client.delete(f"/v1/sessions/{sid}/messages/1")
    assert deleted.status_code == 200
    assert [m["content"] for m in deleted.json()["messages"]] == [
        original[0]["content"],
        *(m["content"] for m in original[2:]),
    ]
    assert len(await _messages(client, bid)) == 5


async def test_session_actions_refuse_what_they_cannot_do(client: httpx.AsyncClient) -> None:
    sid = await _session(client)  # only the greeting
    swipe = await client.post(f"/v1/sessions/{sid}/swipe", json={})
    assert swipe.status_code == 409 and swipe.json()["error"]["code"] == "no_reply_to_swipe"
    await _turn(client, sid, "hi")
    cases: list[tuple[str, str, dict[str, Any], int, str | None]] = [
        ("post", f"/v1/sessions/{sid}/swipe", {"messages": []}, 400, "messages"),
        ("post", f"/v1/sessions/{sid}/swipe", {"session_id": "x"}, 400, "session_id"),
        ("post", f"/v1/sessions/{sid}/swipe", {"n": 2}, 400, "n"),
        ("post", f"/v1/sessions/{sid}/swipe", {"bogus": 1}, 400, "bogus"),
        ("post", f"/v1/sessions/{sid}/dance", {}, 400, "path.action"),
        ("post", "/v1/sessions/sess_nope/continue", {}, 404, "session_id"),
        ("patch", f"/v1/sessions/{sid}/messages/9", {"content": "x"}, 404, "index"),
        ("patch", f"/v1/sessions/{sid}/messages/0", {"swipe_id": 3}, 400, "swipe_id"),
        ("patch", f"/v1/sessions/{sid}/messages/0", {}, 400, None),
        ("patch", f"/v1/sessions/{sid}/messages/0", {"content": "x" * 100_001}, 400, "content"),
        ("patch", f"/v1/sessions/{sid}/messages/-1", {"content": "x"}, 400, "path.index"),
        ("post", f"/v1/sessions/{sid}/branch", {"at": 4}, 400, "at"),
        ("post", "/v1/sessions/sess_nope/branch", {"at": 0}, 404, "session_id"),
    ]
    for method, url, body, status, param in cases:
        resp = await client.request(method, url, json=body)
        assert resp.status_code == status, (url, body, resp.text)
        if param is not None:
            assert resp.json()["error"]["param"] == param, (url, body, resp.text)
    assert (await client.delete(f"/v1/sessions/{sid}/messages/7")).status_code == 404
    # The chat route's own field needs a session, and takes no messages with an action.
    plain = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "session_action": "swipe", "messages": []},
    )
    assert plain.status_code == 400 and plain.json()["error"]["param"] == "session_action"
    via_chat = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "session_id": sid, "session_action": "impersonate"},
    )
    assert via_chat.status_code == 200, via_chat.text


async def test_warm_prefills_the_next_turns_prefix_in_the_batch_class(
    client: httpx.AsyncClient, gw: Gateway, tokenizer: Any
) -> None:
    sid = await _session(client)
    await _turn(client, sid, "Hello")
    before = await _messages(client, sid)
    warm = await client.post(f"/v1/sessions/{sid}/warm")
    assert warm.status_code == 200, warm.text
    body = warm.json()
    assert body["object"] == "session.warm" and body["prompt_tokens"] > 0
    job = gw.engine.jobs[warm.headers["x-request-id"]]
    assert job.priority_class == "batch" and job.max_tokens == 1
    nxt = await _turn(client, sid, "Next")
    # The next turn's prompt goes on from the warmed conversation (all of it but the
    # closing instructions, none here but the end of the template).
    warmed, asked = list(job.prompt_token_ids), _prompt(gw, nxt)
    assert asked[: len(warmed)] == warmed, tokenizer.decode(warmed)[-60:]
    assert await _messages(client, sid) == [*before, *(await _messages(client, sid))[-2:]]
    refused = await client.post(f"/v1/sessions/{sid}/warm", json={"max_tokens": 5, "x": 1})
    # A warm generates one token, never streamed: the route sets them.
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def _card(name: str) -> dict[str, Any]:
    data = {**V2_CARD["data"], "name": name, "description": f"{{{{char}}}} is {name}."}
    return {**V2_CARD, "data": {**data, "character_book": None}}


async def test_a_group_session_keeps_its_prefix_as_the_speaker_changes(
    client: httpx.AsyncClient, gw: Gateway, tokenizer: Any
) -> None:
    ids = [(await client.post("/v1/characters", json=_card(n))).json()["id"] for n in NAMES]
    created = await client.post("/v1/sessions", json={"character_ids": ids, "user_name": "Ada"})
    assert created.status_code == 200, created.text
    sid = created.json()["id"]
    assert created.json()["character_ids"] == ids
    assert created.json()["messages"][0]["name"] == "Mira"
    texts: list[str] = []
    for message, extra in [
        ("Hello, all of you.", {}),  # round robin: after Mira, Rook
        ("Vale, what do you think?", {}),  # named
        ("And you?", {"speaker": ids[0]}),  # chosen by the client
        ("Go on.", {}),  # after Mira, Rook again
    ]:
        resp = await client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "session_id": sid,
                "messages": [{"role": "user", "content": message}],
                "max_tokens": 2,
                **extra,
            },
        )
        assert resp.status_code == 200, resp.text
        texts.append(tokenizer.decode(_prompt(gw, resp)))
    stored = await _messages(client, sid)
    assert [m.get("name") for m in stored if m["role"] == "assistant"] == [
        "Mira",
        "Rook",
        "Vale",
        "Mira",
        "Rook",
    ]
    # Everyone's persona in every prompt; each prompt goes on from the one before up to
    # its closing instructions (the speaker's nudge), so the cache holds the rest.
    for text, name in zip(texts, ["Rook", "Vale", "Mira", "Rook"], strict=True):
        assert all(f"[{n}]" in text for n in NAMES)
        assert text.rstrip().endswith(
            f"[Write the next reply only as {name}.]<|im_end|>\n<|im_start|>assistant"
        )
        # Replies carry their speaker's name in the history.
        assert "Rook:  t0 t1" in text or text is texts[0], text[-300:]
    for earlier, later in itertools.pairwise(texts):
        shared = earlier[: earlier.rindex("<|im_start|>system")]
        assert later.startswith(shared)


NAMES = ["Mira", "Rook", "Vale"]


async def test_group_session_refusals(client: httpx.AsyncClient) -> None:
    ids = [(await client.post("/v1/characters", json=_card(n))).json()["id"] for n in NAMES]
    solo = await _session(client)
    cases: list[tuple[str, dict[str, Any], int, str | None]] = [
        ("/v1/sessions", {"character_ids": ids[:1]}, 400, "character_ids"),
        ("/v1/sessions", {"character_ids": [ids[0], ids[0]]}, 400, None),
        ("/v1/sessions", {"character_ids": ids, "character_id": ids[0]}, 400, None),
        ("/v1/sessions", {"character_ids": [*ids[:2], "char_nope"]}, 404, "character_id"),
        ("/v1/sessions", {"character_ids": ids * 3}, 400, "character_ids"),
    ]
    for url, body, status, param in cases:
        resp = await client.post(url, json=body)
        assert resp.status_code == status, (body, resp.text)
        if param is not None:
            assert resp.json()["error"]["param"] == param, (body, resp.text)
    group = (await client.post("/v1/sessions", json={"character_ids": ids})).json()["id"]
    for sid, speaker in [(group, "char_nope"), (solo, ids[0])]:
        resp = await client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "session_id": sid,
                "speaker": speaker,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "speaker", resp.text
