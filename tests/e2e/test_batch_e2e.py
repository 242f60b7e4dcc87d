"""End to end with the real engine: the Batch API (completed with output and error files,
cancel, a gateway killed mid-batch) and the backfill driver (a few dialogues, then a rerun
that does no new work). Needs the Batch API installed in the gateway app."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from cluster.backfill.driver import Options, backfill
from cluster.runtime.net import free_port
from tests.e2e.conftest import ROOT, Stack
from tests.polling import eventually

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
PERSONA = "You are Captain Mira Vance, captain of the starship Wayfarer. Always stay in character."


def request_line(custom_id: str, max_tokens: int = 8, **body: Any) -> str:
    return json.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": PERSONA},
                    {"role": "user", "content": f"Report number {custom_id}, captain?"},
                ],
                "max_tokens": max_tokens,
                "temperature": 0,
                **body,
            },
        }
    )


async def submit(client: openai.AsyncOpenAI, lines: list[str]) -> Any:
    file = await client.files.create(
        file=("batch.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch"
    )
    return await client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


async def wait_status(
    client: openai.AsyncOpenAI, batch_id: str, *statuses: str, timeout_s: float = 240
) -> Any:
    found: dict[str, Any] = {}

    async def done() -> bool:
        found["batch"] = await client.batches.retrieve(batch_id)
        return bool(found["batch"].status in statuses)

    await eventually(done, timeout_s=timeout_s, every_s=0.5)
    return found["batch"]


async def read_jsonl(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in (await client.files.content(file_id)).text.splitlines() if x]


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    yield c
    await c.close()


async def test_a_small_batch_completes_with_output_and_error_files(
    client: openai.AsyncOpenAI,
) -> None:
    lines = [
        request_line("a"),
        "{this is not json",
        request_line("b"),
        request_line("nope", model="gpt-unknown"),
        request_line("c"),
    ]
    batch = await submit(client, lines)
    done = await wait_status(client, batch.id, "completed", "failed", "expired")
    assert done.status == "completed", done
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (5, 3, 2)
    output = await read_jsonl(client, done.output_file_id)
    assert [o["custom_id"] for o in output] == ["a", "b", "c"]
    for out in output:
        body = out["response"]["body"]
        assert out["response"]["status_code"] == 200 and out["error"] is None
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["choices"][0]["message"]["content"].strip()
        assert 0 < body["usage"]["completion_tokens"] <= 8
        assert body["usage"]["prompt_tokens"] > 20  # the persona is in the prompt
    errors = {e["line"]: e for e in await read_jsonl(client, done.error_file_id)}
    assert sorted(errors) == [2, 4]
    assert errors[2]["error"]["code"] == "invalid_json_line"
    assert errors[4]["response"]["status_code"] == 404
    assert errors[4]["response"]["body"]["error"]["code"] == "model_not_found"


async def test_cancel_a_running_batch(client: openai.AsyncOpenAI) -> None:
    batch = await submit(
        client, [request_line(f"long-{i}", max_tokens=200, ignore_eos=True) for i in range(6)]
    )
    await wait_status(client, batch.id, "in_progress", timeout_s=60)
    cancelling = await client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = await wait_status(client, batch.id, "cancelled", timeout_s=60)
    assert done.cancelled_at is not None
    assert done.request_counts.total == 6
    assert done.request_counts.completed < 6
    errors = await read_jsonl(client, done.error_file_id)
    finished = await read_jsonl(client, done.output_file_id)
    assert {e["error"]["code"] for e in errors} <= {"batch_cancelled"}
    assert len(errors) + len(finished) == 6


def _start_gateway(stack: Stack, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "CHARSERVE_REDIS_URL": stack.redis_url,
        "CHARSERVE_PORT": str(port),
        "CHARSERVE_LOG_FORMAT": "json",
        "CHARSERVE_BATCH_LEASE_MS": "2000",
    }
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "cluster.ops.cli", "gateway"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def _ready(base_url: str, proc: subprocess.Popen[bytes]) -> None:
    import httpx

    async def up() -> bool:
        assert proc.poll() is None, "the gateway exited"
        try:
            async with httpx.AsyncClient(timeout=2) as http:
                return (await http.get(f"{base_url}/ready")).status_code == 200
        except httpx.HTTPError:
            return False

    await eventually(up, timeout_s=120, every_s=0.5)


async def test_a_gateway_killed_mid_batch(stack: Stack, tmp_path: Path) -> None:
    """A second gateway takes the batch, is killed (SIGKILL) mid-batch and restarted; the
    batch completes with every line exactly once."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = tmp_path / "gateway.log"
    proc = _start_gateway(stack, port, log)
    try:
        await _ready(base_url, proc)
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x") as client:
            batch = await submit(
                client,
                [request_line(f"r{i}", max_tokens=48, ignore_eos=True) for i in range(8)],
            )
            await wait_status(client, batch.id, "in_progress", timeout_s=60)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at = time.monotonic()
        proc = _start_gateway(stack, port, log)
        await _ready(base_url, proc)
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x") as client:
            mid = await client.batches.retrieve(batch.id)
            assert mid.status in ("in_progress", "finalizing", "completed")
            done = await wait_status(client, batch.id, "completed", timeout_s=300)
            output = await read_jsonl(client, done.output_file_id)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert time.monotonic() - killed_at < 300
    assert done.request_counts.completed == 8 and done.request_counts.failed == 0
    assert sorted(o["custom_id"] for o in output) == sorted(f"r{i}" for i in range(8))
    for out in output:
        assert out["response"]["body"]["usage"]["completion_tokens"] == 48


CARD = {
    "spec": "chara_card_v2",
    "spec_version": "2.0",
    "data": {
        "name": "Captain Mira Vance",
        "description": "{{char}} is the captain of the starship Wayfarer.",
        "personality": "sharp-tongued, kind",
        "scenario": "The Wayfarer drifts near the Kessler Belt.",
        "first_mes": "Welcome aboard, {{user}}.",
        "mes_example": "",
        "creator_notes": "",
        "system_prompt": "",
        "post_history_instructions": "",
        "alternate_greetings": [],
        "tags": [],
        "creator": "",
        "character_version": "1",
        "extensions": {},
    },
}


async def test_backfill_a_few_dialogues_then_a_rerun_does_nothing(
    stack: Stack, tmp_path: Path
) -> None:
    source = tmp_path / "dialogues.jsonl"
    out = tmp_path / "dialogues.out.jsonl"
    dialogues = [
        {
            "id": f"d{i}",
            "character": CARD,
            "persona": {"name": "Sam", "description": "A nervous cadet."},
            "turns": 2,
            "seed": i,
        }
        for i in range(3)
    ]
    source.write_text("".join(json.dumps(d) + "\n" for d in dialogues))
    options = Options(
        base_url=stack.base_url,
        api_key=None,
        model=None,
        concurrency=3,
        max_tokens=8,
        user_max_tokens=8,
        progress=False,
    )
    report = await backfill(source, out, options)
    assert (report.completed, report.failed) == (3, 0)
    assert report.requests == 3 * 4  # user, character, user, character
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == ["d0", "d1", "d2"]
    for record in records:
        roles = [m["role"] for m in record["messages"]]
        assert roles == ["system", "assistant", "user", "assistant", "user", "assistant"]
        assert "Wayfarer" in record["messages"][0]["content"]
        assert any(m["content"] for m in record["messages"][2:])
        assert 0 < record["usage"]["completion_tokens"] <= 4 * 8
    before = out.read_text()
    again = await backfill(source, out, options)
    assert (again.completed, again.skipped, again.requests) == (0, 3, 0)
    assert out.read_text() == before
