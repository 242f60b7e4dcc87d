"""Session memory through the real gateway: a long scripted session gets its oldest turns
summarised by a batch-class job, the summary is stored and placed after the persona, later
summaries extend it, and the prompt stays within the window throughout."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from cluster.wire.keys import Keys
from gateway.characters.persona_chat import MEMORY_LABEL
from tests.fakes import FakeEngine
from tests.gateway.conftest import Gateway, gateway_settings, serve_gateway
from tests.gateway.test_characters import MODEL, V2_CARD
from workers.loop.config import ConsumerConfig
from workers.loop.consumer import Consumer

WINDOW = 1024


@pytest.fixture(scope="module")
async def gw(redis_url: str, model_path: str) -> AsyncIterator[Gateway]:
    settings = gateway_settings(
        redis_url,
        model_path,
        max_model_len=WINDOW,
        heartbeat_ms=1000,
        memory_share=0.5,
        memory_keep_messages=4,
        memory_max_tokens=24,
    )
    keys = Keys(settings.namespace)
    engine = FakeEngine(max_slots=8, delay_s=0.0005)
    consumer = Consumer(redis_url, keys, engine, ConsumerConfig(heartbeat_ms=100), worker_id="w")
    await consumer.start()
    async with serve_gateway(settings) as base_url:
        yield Gateway(base_url, engine, keys, settings)
    await consumer.close()


async def test_a_long_session_is_summarised_and_stays_in_the_window(
    gw: Gateway, model_path: str
) -> None:
    tokenizer: Any = AutoTokenizer.from_pretrained(model_path)
    async with httpx.AsyncClient(base_url=gw.base_url, timeout=30) as http:
        character = (await http.post("/v1/characters", json=V2_CARD)).json()
        sid = (
            await http.post(
                "/v1/sessions", json={"character_id": character["id"], "user_name": "Ada"}
            )
        ).json()["id"]
        covers: list[int] = []
        prompt_lengths: list[int] = []
        for n in range(200):
            resp = await http.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "session_id": sid,
                    "messages": [{"role": "user", "content": f"Turn {n}: the ship sails on."}],
                    "max_tokens": 12,
                },
            )
            assert resp.status_code == 200, resp.text
            job = gw.engine.jobs[resp.headers["x-request-id"]]
            prompt_lengths.append(len(job.prompt_token_ids))
            session = (await http.get(f"/v1/sessions/{sid}")).json()
            memory = session.get("memory")
            if memory and (not covers or memory["covers"] != covers[-1]):
                covers.append(memory["covers"])
        # Every prompt fit the window with room for its reply.
        assert max(prompt_lengths) <= WINDOW - 12
        # Summaries were made, more than once (each extends the one before), by batch jobs.
        assert len(covers) >= 2 and covers == sorted(covers), covers
        memory_jobs = [j for j in gw.engine.jobs.values() if j.id.startswith("mem-")]
        assert memory_jobs and all(j.priority_class == "batch" for j in memory_jobs)
        previous = tokenizer.decode(memory_jobs[-1].prompt_token_ids)
        assert "Previous summary:" in previous and "Transcript:" in previous
        # The latest prompt carries the memory after the persona, and the covered turns
        # are no longer sent.
        await asyncio.sleep(1)  # a summary job in flight lands
        session = (await http.get(f"/v1/sessions/{sid}")).json()
        resp = await http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "session_id": sid,
                "messages": [{"role": "user", "content": "One more."}],
                "max_tokens": 1,
            },
        )
        last = tokenizer.decode(gw.engine.jobs[resp.headers["x-request-id"]].prompt_token_ids)
        assert MEMORY_LABEL.strip() in last
        assert last.index("Captain Mira is a sky-pirate") < last.index(MEMORY_LABEL.strip())
        covered = session["memory"]["covers"]
        assert covered > 100
        older = [m["content"] for m in session["messages"][:covered] if m["role"] == "user"]
        assert older and all(text not in last for text in older)
        # Every turn the memory does not cover is sent: nothing was cut.
        newer = [m["content"] for m in session["messages"][covered:] if m["role"] == "user"]
        assert newer and all(text in last for text in newer)
