"""LoRA adapters on the replica side: ``engine.lora_adapters`` is validated when the config
is built (and the folders when the replica starts), rendered for vLLM's own server, and a
consumer advertises its adapters and claims their jobs, and only it does."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from pydantic import ValidationError

from cluster.wire import protocol
from cluster.wire.keys import Keys
from cluster.wire.protocol import WorkerStats
from cluster.wire.queue import JobQueue
from tests.fakes import FakeEngine
from tests.workers.test_consumer import Inbox, make_job
from tests.workers.test_engine_config import (  # noqa: F401 (fixtures)
    engine_args_fields,
    vllm_server_parser,
)
from workers.engines.config import EngineConfig
from workers.loop.config import ConsumerConfig
from workers.loop.consumer import Consumer

LORA = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}


def config(adapters: dict[str, str], **engine_args: Any) -> EngineConfig:
    return EngineConfig(lora_adapters=adapters, engine_args={**LORA, **engine_args})


def test_adapters_are_named_local_folders_with_lora_on() -> None:
    ok = config({"pirate": "/adapters/pirate", "poet.v2": "/adapters/poet"})
    assert ok.lora_adapters["pirate"] == "/adapters/pirate"
    assert "lora_adapters" not in ok.engine_kwargs("/m")  # not a vLLM EngineArgs keyword
    with pytest.raises(ValidationError, match=r"needs engine_args\.enable_lora"):
        EngineConfig(lora_adapters={"pirate": "/a"})
    with pytest.raises(ValidationError, match="is the served model's name"):
        config({"smollm2-135m-instruct": "/a"})
    with pytest.raises(ValidationError, match="not an absolute local path"):
        config({"pirate": "org/pirate-lora"})  # a hub id: never downloaded at run time


@pytest.mark.parametrize("name", ["", "-x", "a|b", "a:b", "a/b", "x" * 65, "sp ace", "é"])
def test_adapter_names_have_a_plain_bounded_shape(name: str) -> None:
    with pytest.raises(ValidationError, match="must match"):
        config({name: "/a"})


def test_adapters_fit_the_engines_room() -> None:
    with pytest.raises(ValidationError, match="vLLM keeps at most 2"):
        config({"a": "/a", "b": "/b", "c": "/c"})
    with pytest.raises(ValidationError, match="vLLM keeps at most 1"):
        EngineConfig(lora_adapters={"a": "/a", "b": "/b"}, engine_args={"enable_lora": True})
    roomy = config({"a": "/a", "b": "/b", "c": "/c"}, max_cpu_loras=4)
    assert roomy.adapter_room() == 4
    many = {f"a{i}": f"/a{i}" for i in range(65)}
    with pytest.raises(ValidationError, match="at most 64 LoRA adapters"):
        config(many, max_cpu_loras=100)


def test_adapter_folders_are_checked_at_the_replica_start(tmp_path: Path) -> None:
    (tmp_path / "pirate").mkdir()
    (tmp_path / "pirate" / "adapter_config.json").write_text("{}")
    cfg = config({"pirate": str(tmp_path / "pirate"), "gone": str(tmp_path / "gone")})
    with pytest.raises(ValueError, match=r"'gone'.*has no adapter_config\.json"):
        cfg.adapter_paths()
    cfg = config({"pirate": str(tmp_path / "pirate")})
    assert cfg.adapter_paths() == {"pirate": tmp_path / "pirate"}


def test_vllms_own_server_gets_the_same_adapters(
    vllm_server_parser: argparse.ArgumentParser,  # noqa: F811
) -> None:
    cfg = config({"pirate": "/adapters/pirate", "poet": "/adapters/poet"})
    parsed = vllm_server_parser.parse_args(cfg.server_args("m", "127.0.0.1", 8100))
    assert parsed.enable_lora is True
    assert {m.name: m.path for m in parsed.lora_modules} == {
        "pirate": "/adapters/pirate",
        "poet": "/adapters/poet",
    }


async def test_a_consumer_advertises_and_claims_only_its_adapters(
    redis_url: str, redis: aioredis.Redis, keys: Keys
) -> None:
    plain, lora = FakeEngine(max_slots=2), FakeEngine(max_slots=2)
    lora.loras = frozenset({"pirate"})
    consumers = [
        Consumer(redis_url, keys, engine, ConsumerConfig(heartbeat_ms=100), worker_id=name)
        for engine, name in ((plain, "w-plain"), (lora, "w-lora"))
    ]
    for c in consumers:
        await c.start()
    try:
        stats = protocol.decode_as(await redis.get(keys.worker_stats("w-lora")), WorkerStats)
        assert stats.adapters == ["pirate"]
        queue = JobQueue(redis, keys, base_model="m")
        async with Inbox(redis, keys.inbox("g1")) as inbox:
            for i in range(4):
                job = make_job(f"p{i}", inbox.channel)
                await queue.enqueue(dataclasses.replace(job, model="pirate"))
            finals = [(await inbox.final(f"p{i}"))[-1] for i in range(4)]
        assert {f.worker_id for f in finals} == {"w-lora"}
        assert set(lora.jobs) == {f"p{i}" for i in range(4)} and not plain.jobs
    finally:
        for c in consumers:
            await c.close()
