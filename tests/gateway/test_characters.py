"""Characters and sessions through the real gateway: import, round trip, bad cards, a
session answered in character, turns recorded only on success, and replica affinity."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from cluster.characters.cards import card_to_png
from cluster.wire.keys import Keys
from tests.fakes import FakeEngine
from tests.gateway.conftest import Gateway, gateway_settings, serve_gateway
from workers.loop.config import ConsumerConfig
from workers.loop.consumer import Consumer

MODEL = "smollm2-135m-instruct"

V2_CARD: dict[str, Any] = {
    "spec": "chara_card_v2",
    "spec_version": "2.0",
    "data": {
        "name": "Captain Mira",
        "description": "{{char}} is a sky-pirate who calls {{user}} 'deckhand'.",
        "personality": "bold, teasing",
        "scenario": "Aboard the airship Kestrel.",
        "first_mes": "Welcome aboard, {{user}}! I'm {{char}}.",
        "mes_example": "<START>\n{{user}}: Hi\n{{char}}: Ahoy!",
        "creator_notes": "SECRET-NOTES never in prompts",
        "system_prompt": "",
        "post_history_instructions": "",
        "alternate_greetings": ["Oi, <USER>! Grab a rope."],
        "tags": ["pirate"],
        "creator": "someone",
        "character_version": "1",
        "extensions": {"fancy_frontend": {"color": "teal", "nested": [1, 2]}},
        "character_book": {
            "entries": [
                {
                    "keys": ["kestrel"],
                    "content": "LORE: the Kestrel has copper sails.",
                    "enabled": True,
                    "insertion_order": 1,
                }
            ]
        },
        "unknown_field": {"kept": True},
    },
    "top_level_unknown": 7,
}


@pytest.fixture(scope="module")
async def duo(redis_url: str, model_path: str) -> AsyncIterator[tuple[Gateway, FakeEngine]]:
    """A gateway with two workers (w-a, w-b), so affinity has a choice to make."""
    # A generous freshness window: a loaded CI machine may delay a heartbeat.
    settings = gateway_settings(redis_url, model_path, max_model_len=1024, heartbeat_ms=1000)
    keys = Keys(settings.namespace)
    engines = [FakeEngine(max_slots=8, delay_s=0.002) for _ in range(2)]
    consumers = [
        Consumer(redis_url, keys, engine, ConsumerConfig(heartbeat_ms=100), worker_id=name)
        for engine, name in zip(engines, ("w-a", "w-b"), strict=True)
    ]
    for consumer in consumers:
        await consumer.start()
    async with serve_gateway(settings) as base_url:
        yield Gateway(base_url, engines[0], keys, settings), engines[1]
    for consumer in consumers:
        await consumer.close()


@pytest.fixture
async def client(duo: tuple[Gateway, FakeEngine]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=duo[0].base_url, timeout=30) as http:
        yield http


async def test_json_card_round_trips_with_unknown_fields(client: httpx.AsyncClient) -> None:
    created = await client.post("/v1/characters", json=V2_CARD)
    assert created.status_code == 200, created.text
    character = created.json()
    assert character["id"].startswith("char_") and character["name"] == "Captain Mira"
    fetched = await client.get(f"/v1/characters/{character['id']}")
    assert fetched.json()["card"] == V2_CARD  # every unknown field and extension kept
    listed = (await client.get("/v1/characters")).json()["data"]
    assert character["id"] in [c["id"] for c in listed]
    assert all("card" not in c for c in listed)
    deleted = await client.delete(f"/v1/characters/{character['id']}")
    assert deleted.json()["deleted"] is True
    assert (await client.get(f"/v1/characters/{character['id']}")).status_code == 404
    assert (await client.delete(f"/v1/characters/{character['id']}")).status_code == 404


@pytest.mark.parametrize("how", ["multipart", "raw"])
async def test_png_cards_import(client: httpx.AsyncClient, how: str) -> None:
    v3 = {"spec": "chara_card_v3", "spec_version": "3.0", "data": {**V2_CARD["data"]}}
    v3["data"]["name"] = "Mira Three"
    png = card_to_png(v3, chara=V2_CARD)  # ccv3 beside a V2 fallback: ccv3 wins
    if how == "multipart":
        resp = await client.post("/v1/characters", files={"file": ("mira.png", png, "image/png")})
    else:
        resp = await client.post(
            "/v1/characters", content=png, headers={"Content-Type": "image/png"}
        )
    assert resp.status_code == 200, resp.text
    assert resp.json()["name"] == "Mira Three" and resp.json()["spec"] == "chara_card_v3"


async def test_bad_cards_are_refused_and_nothing_is_stored(client: httpx.AsyncClient) -> None:
    before = len((await client.get("/v1/characters")).json()["data"])
    cases = [
        (b"{not json", "application/json", 400),
        (json.dumps({"spec": "chara_card_v9", "data": {}}).encode(), "application/json", 400),
        (json.dumps({"name": 5}).encode(), "application/json", 400),
        (b"\x89PNG\r\n\x1a\nbroken", "image/png", 400),
        (json.dumps({"name": "x" * 10, "description": "y" * 3_000_000}).encode(), None, 413),
    ]
    for body, content_type, status in cases:
        headers = {"Content-Type": content_type} if content_type else {}
        resp = await client.post("/v1/characters", content=body, headers=headers)
        assert resp.status_code == status, (body[:30], resp.text)
        assert resp.json()["error"]["message"]
    assert len((await client.get("/v1/characters")).json()["data"]) == before


async def _create_session(client: httpx.AsyncClient, **extra: Any) -> dict[str, Any]:
    character = (await client.post("/v1/characters", json=V2_CARD)).json()
    resp = await client.post(
        "/v1/sessions", json={"character_id": character["id"], "user_name": "Ada", **extra}
    )
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


async def test_session_opens_with_the_greeting(client: httpx.AsyncClient) -> None:
    session = await _create_session(client)
    assert session["greeting"] == "Welcome aboard, Ada! I'm Captain Mira."
    assert session["messages"] == [{"role": "assistant", "content": session["greeting"]}]
    alternate = await _create_session(client, greeting_index=1)
    assert alternate["greeting"] == "Oi, Ada! Grab a rope."
    bad = await client.post(
        "/v1/sessions",
        json={"character_id": session["character_id"], "greeting_index": 5},
    )
    assert bad.status_code == 400
    unknown = await client.post("/v1/sessions", json={"character_id": "char_nope"})
    assert unknown.status_code == 404


async def test_a_session_turn_is_answered_in_character_and_recorded(
    client: httpx.AsyncClient, duo: tuple[Gateway, FakeEngine], model_path: str
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    session = await _create_session(client)
    for turn, text in enumerate(["Tell me about the Kestrel.", "And the crew?"], start=1):
        resp = await client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "session_id": session["id"],
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 3,
                "stream": turn == 2,
            },
        )
        assert resp.status_code == 200, resp.text
        request_id = resp.headers["x-request-id"]
        engines = [duo[0].engine, duo[1]]
        job = next(e.jobs[request_id] for e in engines if request_id in e.jobs)
        prompt = tokenizer.decode(job.prompt_token_ids)
        assert "Captain Mira is a sky-pirate who calls Ada 'deckhand'." in prompt
        assert "LORE: the Kestrel has copper sails." in prompt  # keyword in history
        assert "SECRET-NOTES" not in prompt and "{{" not in prompt
        assert text in prompt and session["greeting"] in prompt
        if turn == 2:
            assert "Tell me about the Kestrel." in prompt and " t0 t1 t2" in prompt
    stored = (await client.get(f"/v1/sessions/{session['id']}")).json()["messages"]
    assert [m["role"] for m in stored] == ["assistant", "user", "assistant", "user", "assistant"]
    assert stored[-1]["content"] == " t0 t1 t2"


async def test_failed_or_cancelled_turns_append_nothing(
    client: httpx.AsyncClient, duo: tuple[Gateway, FakeEngine]
) -> None:
    session = await _create_session(client)
    body = {
        "model": MODEL,
        "session_id": session["id"],
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 400,
        "stream": True,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                break  # walk away mid-reply
    await asyncio.sleep(0.3)
    for engine in (duo[0].engine, duo[1]):
        engine.fail_with = "boom"
    try:
        failed = await client.post("/v1/chat/completions", json={**body, "stream": False})
        assert failed.status_code >= 500
    finally:
        for engine in (duo[0].engine, duo[1]):
            engine.fail_with = None
    stored = (await client.get(f"/v1/sessions/{session['id']}")).json()["messages"]
    assert len(stored) == 1  # only the greeting


async def test_bad_session_requests(client: httpx.AsyncClient) -> None:
    session = await _create_session(client)
    two = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    cases = [
        ({"session_id": session["id"], "messages": two}, 400),
        ({"session_id": session["id"], "messages": [{"role": "system", "content": "x"}]}, 400),
        ({"session_id": "sess_nope", "messages": two[:1]}, 404),
        ({"session_id": 5, "messages": two[:1]}, 400),
    ]
    for extra, status in cases:
        resp = await client.post("/v1/chat/completions", json={"model": MODEL, **extra})
        assert resp.status_code == status, (extra, resp.text)
    assert (await client.delete(f"/v1/sessions/{session['id']}")).status_code == 200
    gone = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "session_id": session["id"], "messages": two[:1]},
    )
    assert gone.status_code == 404


async def test_next_turns_go_back_to_the_same_replica(
    client: httpx.AsyncClient, duo: tuple[Gateway, FakeEngine], redis: aioredis.Redis
) -> None:
    sessions = [await _create_session(client) for _ in range(6)]

    async def turn(session: dict[str, Any], n: int) -> str:
        resp = await client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "session_id": session["id"],
                "messages": [{"role": "user", "content": f"turn {n}"}],
                "max_tokens": 20,
            },
        )
        assert resp.status_code == 200
        return "w-a" if resp.headers["x-request-id"] in duo[0].engine.jobs else "w-b"

    workers: list[str] = []
    for n in range(4):  # the sessions' turns run concurrently, as users' would
        workers.extend(await asyncio.gather(*(turn(s, n) for s in sessions)))
    by_session = [workers[i :: len(sessions)] for i in range(len(sessions))]
    # After its first turn, each session stays on one replica.
    for served in by_session:
        assert len(set(served[1:])) == 1, by_session
    assert await redis.hlen(duo[0].keys.prefer) == 0
