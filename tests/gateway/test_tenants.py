"""API keys, tenant isolation, rate limits and request bounds, through a real gateway."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as aioredis

from cluster.wire.keys import Keys
from cluster.wire.tenants import ApiKeys, Limits
from tests.fakes import FakeEngine
from tests.gateway.conftest import Gateway, gateway_settings, serve_gateway
from workers.loop.config import ConsumerConfig
from workers.loop.consumer import Consumer

MODEL = "smollm2-135m-instruct"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
async def keyed(redis_url: str, model_path: str) -> AsyncIterator[Gateway]:
    """A gateway whose namespace has API keys, with no lookup cache and small bounds."""
    settings = gateway_settings(
        redis_url, model_path, auth="keys", auth_cache_s=0, max_body_bytes=4096, max_messages=8
    )
    keys = Keys(settings.namespace)
    engine = FakeEngine(max_slots=8, delay_s=0.001)
    consumer = Consumer(redis_url, keys, engine, ConsumerConfig(heartbeat_ms=200))
    await consumer.start()
    async with serve_gateway(settings) as base_url:
        yield Gateway(base_url, engine, keys, settings)
    engine.release.set()
    await consumer.close()


@pytest.fixture(scope="module")
async def api_keys(keyed: Gateway, redis_url: str) -> AsyncIterator[ApiKeys]:
    from cluster.runtime.redis_client import connect

    client = connect(redis_url)
    yield ApiKeys(client, keyed.keys)
    await client.aclose()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def keyed_tables_are_empty(api_keys: ApiKeys) -> bool:
    return await api_keys.list() == []


async def test_keys_are_stored_hashed(api_keys: ApiKeys, redis: aioredis.Redis, keys: Keys) -> None:
    store = ApiKeys(redis, keys)
    key, record = await store.create("acme", "ci")
    assert key.startswith(f"csk-{record.id}-")
    dump = b"".join(await redis.hvals(keys.api_keys)) + b"".join(await redis.hkeys(keys.api_keys))
    assert key.encode() not in dump
    assert await store.lookup(key) == record
    assert [r.id for r in await store.list()] == [record.id]
    assert await store.revoke(record.id)
    assert await store.lookup(key) is None
    with pytest.raises(ValueError):
        await store.create("no spaces allowed")


async def test_every_v1_route_needs_a_key(keyed: Gateway, api_keys: ApiKeys) -> None:
    async with httpx.AsyncClient(base_url=keyed.base_url, timeout=30) as http:
        # Before any key exists (a fresh Redis, a failover to an empty replica, a mistyped
        # namespace): 401, never an open door.
        assert await keyed_tables_are_empty(api_keys)
        empty = await http.post("/v1/chat/completions", json=BODY)
        assert empty.status_code == 401, empty.text
    key, _ = await api_keys.create("acme")
    async with httpx.AsyncClient(base_url=keyed.base_url, timeout=30) as http:
        schema = (await http.get("/openapi.json")).json()
        routes = [
            (method.upper(), path.replace("{", "").replace("}", ""))
            for path, item in schema["paths"].items()
            if path.startswith("/v1")
            for method in item
        ]
        assert len(routes) >= 3
        for method, path in routes:
            resp = await http.request(method, path, json=BODY)
            assert resp.status_code == 401, (method, path, resp.text)
            assert resp.json()["error"]["code"] == "invalid_api_key"
            wrong = await http.request(method, path, json=BODY, headers=bearer("csk-0-nope"))
            assert wrong.status_code == 401
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/ready")).status_code == 200
        ok = await http.post("/v1/chat/completions", json=BODY, headers=bearer(key))
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["message"]["content"]


async def test_tenants_cannot_read_each_others_streams(keyed: Gateway, api_keys: ApiKeys) -> None:
    alice, _ = await api_keys.create("alice")
    bob, _ = await api_keys.create("bob")
    async with httpx.AsyncClient(base_url=keyed.base_url, timeout=30) as http:
        done = await http.post(
            "/v1/chat/completions", json={**BODY, "stream": True}, headers=bearer(alice)
        )
        completion = f"chatcmpl-{done.headers['x-request-id']}"
        path = f"/v1/chat/completions/{completion}/events"
        mine = await http.get(path, headers=bearer(alice))
        theirs = await http.get(path, headers=bearer(bob))
    assert mine.status_code == 200 and "[DONE]" in mine.text
    assert theirs.status_code == 404  # not 403: the stream's existence is not revealed


async def test_a_revoked_key_stops_working(keyed: Gateway, api_keys: ApiKeys) -> None:
    key, record = await api_keys.create("carol")
    async with httpx.AsyncClient(base_url=keyed.base_url, timeout=30) as http:
        assert (await http.get("/v1/models", headers=bearer(key))).status_code == 200
        assert await api_keys.revoke(record.id)
        assert (await http.get("/v1/models", headers=bearer(key))).status_code == 401


async def test_a_burst_beyond_the_limit_gets_429_with_headers(
    keyed: Gateway, api_keys: ApiKeys
) -> None:
    key, _ = await api_keys.create("dave")
    await api_keys.set_limits("dave", Limits(rpm=3, tpm=10_000))
    async with httpx.AsyncClient(base_url=keyed.base_url, timeout=30) as http:
        replies = await asyncio.gather(
            *(http.post("/v1/chat/completions", json=BODY, headers=bearer(key)) for _ in range(6))
        )
        statuses = sorted(r.status_code for r in replies)
        assert statuses == [200, 200, 200, 429, 429, 429]
        for resp in replies:
            assert resp.headers["x-ratelimit-limit-requests"] == "3"
            assert resp.headers["x-ratelimit-limit-tokens"] == "10000"
            assert int(resp.headers["x-ratelimit-remaining-requests"]) <= 2
        refused = next(r for r in replies if r.status_code == 429)
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        wait_ms, wait_s = (
            int(refused.headers["retry-after-ms"]),
            int(refused.headers["retry-after"]),
        )
        assert 1 <= wait_ms <= 60_000 and wait_s == -(-wait_ms // 1000)  # the same wait
        assert refused.headers["x-charserve-drop-reason"] == "rate_limited"
        # Another tenant is not affected.
        other, _ = await api_keys.create("erin")
        resp = await http.post("/v1/chat/completions", json=BODY, headers=bearer(other))
        assert resp.status_code == 200


async def test_a_request_larger_than_the_token_limit_is_refused(
    keyed: Gateway, api_keys: ApiKeys
) -> None:
    key, _ = await api_keys.create("frank")
    await api_keys.set_limits("frank", Limits(rpm=0, tpm=20))
    async with httpx.AsyncClient(base_url=keyed.base_url, timeout=30) as http:
        resp = await http.post(
            "/v1/chat/completions", json={**BODY, "max_tokens": 50}, headers=bearer(key)
        )
    assert resp.status_code == 429
    assert resp.json()["error"]["code"] == "tokens_exceed_limit"


async def test_bounds_are_checked_before_anything_is_queued(
    keyed: Gateway, api_keys: ApiKeys, redis: aioredis.Redis
) -> None:
    key, _ = await api_keys.create("gina")
    queued_before = await redis.hlen(keyed.keys.jobs)
    big = {**BODY, "messages": [{"role": "user", "content": "x" * 5000}]}
    many = {**BODY, "messages": [{"role": "user", "content": "hi"}] * 9}

    async def chunked() -> AsyncIterator[bytes]:
        for _ in range(5):
            yield b" " * 1000

    async with httpx.AsyncClient(base_url=keyed.base_url, timeout=30) as http:
        too_big = await http.post("/v1/chat/completions", json=big, headers=bearer(key))
        streamed = await http.post(
            "/v1/chat/completions",
            content=chunked(),
            headers={**bearer(key), "Content-Type": "application/json"},
        )
        too_many = await http.post("/v1/chat/completions", json=many, headers=bearer(key))
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
    assert streamed.status_code == 413
    assert too_many.status_code == 400
    assert too_many.json()["error"]["param"] == "messages"
    assert await redis.hlen(keyed.keys.jobs) == queued_before


def test_keys_command_line(
    redis_url: str, keys: Keys, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cluster.ops.cli import main

    monkeypatch.setenv("CHARSERVE_REDIS_URL", redis_url)
    monkeypatch.setenv("CHARSERVE_NAMESPACE", keys.namespace)
    assert main(["keys", "create", "--tenant", "ops", "--name", "laptop"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("csk-")
    assert main(["keys", "list"]) == 0
    listed = capsys.readouterr().out
    assert '"tenant": "ops"' in listed and key not in listed
    key_id = key.split("-")[1]
    assert main(["keys", "limits", "--tenant", "ops", "--rpm", "5"]) == 0
    assert main(["keys", "revoke", key_id]) == 0
    assert main(["keys", "revoke", key_id]) == 1
    assert main(["keys", "create", "--tenant", "bad name"]) == 2


async def test_characters_and_sessions_are_private_to_their_tenant(
    keyed: Gateway, api_keys: ApiKeys
) -> None:
    alice, _ = await api_keys.create("alice2")
    bob, _ = await api_keys.create("bob2")
    card = {"name": "Nyx", "description": "a quiet owl", "first_mes": "Hoo."}
    async with httpx.AsyncClient(base_url=keyed.base_url, timeout=30) as http:
        char = (await http.post("/v1/characters", json=card, headers=bearer(alice))).json()
        session = (
            await http.post(
                "/v1/sessions", json={"character_id": char["id"]}, headers=bearer(alice)
            )
        ).json()
        as_bob = bearer(bob)
        turn = {
            "model": MODEL,
            "session_id": session["id"],
            "messages": [{"role": "user", "content": "hi"}],
        }
        refused = [
            await http.get(f"/v1/characters/{char['id']}", headers=as_bob),
            await http.delete(f"/v1/characters/{char['id']}", headers=as_bob),
            await http.get(f"/v1/sessions/{session['id']}", headers=as_bob),
            await http.delete(f"/v1/sessions/{session['id']}", headers=as_bob),
            await http.post("/v1/sessions", json={"character_id": char["id"]}, headers=as_bob),
            await http.post("/v1/chat/completions", json=turn, headers=as_bob),
        ]
        assert [r.status_code for r in refused] == [404] * len(refused)
        assert (await http.get("/v1/characters", headers=as_bob)).json()["data"] == []
        # Still there for its owner.
        mine = await http.get(f"/v1/sessions/{session['id']}", headers=bearer(alice))
        assert mine.status_code == 200
