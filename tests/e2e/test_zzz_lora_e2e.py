"""A LoRA adapter on the real engine: a replica loads :data:`ADAPTER` (made at test time
with a fixed seed, ``tests/lora.py``) at its start and advertises it; the same greedy
request through the base model and through the adapter gives different text, the
adapter's reply comes from the replica that loaded it, and a character speaks through it.

Its own stack, started after the shared one stopped (this module sorts last): vLLM's CPU
build runs a LoRA-enabled engine without torch.compile, so enabling LoRA in the shared
stack would run every other end-to-end test on an eager engine, not the compiled one
``ray-configs/local-cpu.yaml`` deploys. This one is that file with LoRA on and eager mode
said explicitly, in a namespace of its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
import yaml

from cluster.runtime.bundled_model import resolve_model
from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import WorkerStats
from cluster.wire.replylog import read_reply_log
from tests.e2e.conftest import ROOT, Stack, start_stack
from tests.lora import write_adapter

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
ADAPTER = "pirate-lora"
NAMESPACE = "lora-e2e"
QUESTION = [{"role": "user", "content": "Tell me about the sea."}]


def _serve_config(folder: Path) -> Path:
    """``ray-configs/local-cpu.yaml`` with LoRA on and :data:`ADAPTER` loaded."""
    adapter = write_adapter(folder / ADAPTER, base_model=resolve_model(None))
    config = yaml.safe_load((ROOT / "ray-configs" / "local-cpu.yaml").read_text())
    engine = config["applications"][0]["args"]["engine"]
    engine["enforce_eager"] = True  # what vLLM's CPU build runs with LoRA on anyway
    engine["engine_args"] = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}
    engine["lora_adapters"] = {ADAPTER: str(adapter)}
    path = folder / "serve-config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def lora_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = _serve_config(tmp_path_factory.mktemp("lora"))
    s = start_stack(redis_url, CHARSERVE_SERVE_CONFIG=str(config), CHARSERVE_NAMESPACE=NAMESPACE)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
async def http(lora_stack: Stack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=lora_stack.base_url, timeout=300) as client:
        yield client


async def _greedy(http: httpx.AsyncClient, model: str) -> tuple[str, str]:
    resp = await http.post(
        "/v1/chat/completions",
        json={"model": model, "messages": QUESTION, "max_tokens": 24, "temperature": 0},
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["model"] == model
    return resp.headers["x-request-id"], body["choices"][0]["message"]["content"]


async def _served_by(redis: aioredis.Redis, request_id: str) -> WorkerStats:
    """The heartbeat of the replica whose chunks are in the request's reply log."""
    keys = Keys(NAMESPACE)
    logged = await read_reply_log(redis, keys, request_id)
    assert logged and logged[-1].is_final
    raw = await redis.get(keys.worker_stats(logged[-1].worker_id))
    assert raw is not None
    return protocol.decode_as(raw, WorkerStats)


async def test_the_adapter_is_listed_as_a_model(http: httpx.AsyncClient) -> None:
    listed = (await http.get("/v1/models")).json()["data"]
    assert {m["id"]: m.get("parent") for m in listed} == {MODEL: None, ADAPTER: MODEL}


async def test_an_adapter_changes_greedy_output_on_the_replica_that_loaded_it(
    lora_stack: Stack, http: httpx.AsyncClient
) -> None:
    _, base = await _greedy(http, MODEL)
    request_id, tuned = await _greedy(http, ADAPTER)
    assert base and tuned and base != tuned, (base, tuned)
    _, again = await _greedy(http, ADAPTER)
    assert again == tuned  # greedy: the adapter's own output is stable
    redis = aioredis.Redis.from_url(lora_stack.redis_url)
    try:
        worker = await _served_by(redis, request_id)
    finally:
        await redis.aclose()
    assert ADAPTER in worker.adapters


async def test_a_character_speaks_through_its_adapter(http: httpx.AsyncClient) -> None:
    card = {"name": "Mira", "description": "{{char}} is a sailor.", "first_mes": "Ahoy."}
    resp = await http.post("/v1/characters", json=card, params={"adapter": ADAPTER})
    assert resp.status_code == 200, resp.text
    session = (await http.post("/v1/sessions", json={"character_id": resp.json()["id"]})).json()
    turn = await http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "session_id": session["id"],
            "messages": QUESTION,
            "max_tokens": 8,
            "temperature": 0,
        },
    )
    assert turn.status_code == 200, turn.text
    assert turn.json()["model"] == ADAPTER


def test_the_lora_stack_stops_cleanly(lora_stack: Stack) -> None:
    assert lora_stack.stop() == 0
    assert lora_stack.leftovers == []
