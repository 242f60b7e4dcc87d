"""LoRA adapters through the real gateway, with two fake workers (one serves the adapter
``pirate``): the models listing, the model check, and characters that speak through an
adapter; an adapter no live worker serves is refused at once, never queued."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from cluster.wire.keys import Keys
from gateway.chat.admission import serves_model
from tests.fakes import FakeEngine
from tests.gateway.conftest import gateway_settings, serve_gateway
from tests.gateway.test_characters import V2_CARD
from workers.loop.config import ConsumerConfig
from workers.loop.consumer import Consumer

MODEL = "smollm2-135m-instruct"


class Duo:
    """A gateway's URL and its two engines: ``lora`` serves ``pirate``, ``plain`` nothing."""

    def __init__(self, base_url: str, lora: FakeEngine, plain: FakeEngine) -> None:
        self.base_url, self.lora, self.plain = base_url, lora, plain

    def engine_of(self, request_id: str) -> FakeEngine:
        return next(e for e in (self.lora, self.plain) if request_id in e.jobs)


@pytest.fixture(scope="module")
async def duo(redis_url: str, model_path: str) -> AsyncIterator[Duo]:
    settings = gateway_settings(redis_url, model_path, max_model_len=1024, heartbeat_ms=1000)
    keys = Keys(settings.namespace)
    lora, plain = FakeEngine(max_slots=8), FakeEngine(max_slots=8)
    lora.loras = frozenset({"pirate"})
    consumers = [
        Consumer(redis_url, keys, engine, ConsumerConfig(heartbeat_ms=100), worker_id=name)
        for engine, name in ((lora, "w-lora"), (plain, "w-plain"))
    ]
    for consumer in consumers:
        await consumer.start()
    async with serve_gateway(settings) as base_url:
        yield Duo(base_url, lora, plain)
    for consumer in consumers:
        await consumer.close()


@pytest.fixture
async def client(duo: Duo) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=duo.base_url, timeout=30) as http:
        yield http


def test_the_model_check_knows_the_base_model_and_the_advertised_adapters() -> None:
    adapters = frozenset({"pirate"})
    assert serves_model(MODEL, adapters, MODEL)
    assert serves_model(MODEL, adapters, "pirate")
    assert not serves_model(MODEL, adapters, "poet")
    assert not serves_model(MODEL, frozenset(), "pirate")


async def test_models_lists_adapters_with_the_base_model_as_parent(
    client: httpx.AsyncClient,
) -> None:
    listed = (await client.get("/v1/models")).json()["data"]
    assert [(m["id"], m.get("parent")) for m in listed] == [(MODEL, None), ("pirate", MODEL)]
    one = await client.get("/v1/models/pirate")
    assert one.status_code == 200 and one.json()["parent"] == MODEL
    missing = await client.get("/v1/models/poet")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    tokens = await client.post("/tokenize", json={"model": "pirate", "prompt": "Ahoy"})
    assert tokens.status_code == 200 and tokens.json()["count"] > 0


async def test_an_unserved_adapter_is_refused_and_never_queued(
    client: httpx.AsyncClient, duo: Duo
) -> None:
    before = len(duo.lora.jobs) + len(duo.plain.jobs)
    resp = await client.post(
        "/v1/chat/completions",
        json={"model": "poet", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert resp.status_code == 404
    assert resp.json()["error"]["param"] == "model"
    assert resp.json()["error"]["code"] == "model_not_found"
    assert len(duo.lora.jobs) + len(duo.plain.jobs) == before


async def test_a_request_naming_an_adapter_runs_on_a_worker_that_loaded_it(
    client: httpx.AsyncClient, duo: Duo
) -> None:
    for _ in range(4):
        resp = await client.post(
            "/v1/chat/completions",
            json={
                "model": "pirate",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "pirate"
        request_id = resp.headers["x-request-id"]
        assert duo.engine_of(request_id) is duo.lora
        assert duo.lora.jobs[request_id].model == "pirate"


async def _character(client: httpx.AsyncClient, adapter: str | None) -> dict[str, Any]:
    params = {"adapter": adapter} if adapter is not None else {}
    resp = await client.post("/v1/characters", json=V2_CARD, params=params)
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


async def _turn(client: httpx.AsyncClient, session_id: str, model: str = MODEL) -> httpx.Response:
    return await client.post(
        "/v1/chat/completions",
        json={
            "model": model,
            "session_id": session_id,
            "messages": [{"role": "user", "content": "Who are you?"}],
            "max_tokens": 2,
        },
    )


async def test_a_character_speaks_through_its_adapter(client: httpx.AsyncClient, duo: Duo) -> None:
    character = await _character(client, "pirate")
    assert character["adapter"] == "pirate"
    listed = (await client.get("/v1/characters")).json()["data"]
    assert next(c for c in listed if c["id"] == character["id"])["adapter"] == "pirate"
    session = (await client.post("/v1/sessions", json={"character_id": character["id"]})).json()
    for _ in range(3):
        resp = await _turn(client, session["id"])
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "pirate"
        request_id = resp.headers["x-request-id"]
        assert duo.engine_of(request_id) is duo.lora
        assert duo.lora.jobs[request_id].model == "pirate"
    # A character without an adapter stays on the base model.
    plain = await _character(client, None)
    assert "adapter" not in plain
    session = (await client.post("/v1/sessions", json={"character_id": plain["id"]})).json()
    resp = await _turn(client, session["id"])
    assert resp.status_code == 200 and resp.json()["model"] == MODEL


@pytest.mark.parametrize("adapter", ["", "pi|rate", "x" * 65, "../etc", "a b"])
async def test_a_characters_adapter_name_is_checked(
    client: httpx.AsyncClient, adapter: str
) -> None:
    resp = await client.post("/v1/characters", json=V2_CARD, params={"adapter": adapter})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "adapter"


async def test_a_characters_unserved_adapter_is_refused_at_its_turn(
    client: httpx.AsyncClient,
) -> None:
    character = await _character(client, "ghost")
    session = (await client.post("/v1/sessions", json={"character_id": character["id"]})).json()
    resp = await _turn(client, session["id"])
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert error["code"] == "model_not_found" and "ghost" in error["message"]
