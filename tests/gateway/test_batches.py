"""The Batch API through real gateways (uvicorn, Redis, a consumer with the deterministic
test engine): files, validation, output and error files, tenancy, cancel, expiry, retry of
refused lines, gateway restarts and several gateways sharing one batch."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI

from cluster.runtime.net import free_port
from cluster.runtime.settings import Settings
from cluster.wire.keys import Keys
from cluster.wire.tenants import ApiKeys
from gateway.app import create_app
from gateway.batches.lines import parse_input
from gateway.batches.runner import BatchRunner
from tests.fakes import FakeEngine
from tests.gateway.conftest import gateway_settings, serve_gateway
from tests.polling import eventually
from workers.loop.config import ConsumerConfig
from workers.loop.consumer import Consumer

MODEL = "smollm2-135m-instruct"
# Batch settings that make the tests quick.
FAST = {
    "batch_lease_ms": 1_000,
    "batch_poll_ms": 50,
    "batch_retry_max_s": 0.2,
    "batch_max_file_bytes": 256 * 1024,
}


def expected(n: int) -> str:
    """What the test engine writes for ``max_tokens=n``."""
    return "".join(f" t{i}" for i in range(n))


def line(custom_id: str, max_tokens: int = 2, **body: Any) -> str:
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"hello {custom_id}"}],
        "max_tokens": max_tokens,
        **body,
    }
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": request}
    )


def jsonl(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


@asynccontextmanager
async def batch_gateway(settings: Settings, **batch: object) -> AsyncIterator[tuple[str, FastAPI]]:
    """A gateway with quick batch settings (``FAST``, updated by ``batch``), served by real
    uvicorn."""
    app = create_app(settings.model_copy(update={**FAST, **batch}))
    async with serve_gateway(settings, app) as base_url:
        yield base_url, app


@asynccontextmanager
async def backend(redis_url: str, keys: Keys, engine: FakeEngine) -> AsyncIterator[Consumer]:
    consumer = Consumer(
        redis_url,
        keys,
        engine,
        ConsumerConfig(heartbeat_ms=200, batch_reserve_slots=0, batch_starts_per_s=0.0),
    )
    await consumer.start()
    try:
        yield consumer
    finally:
        engine.release.set()
        await consumer.close()


@dataclass
class Stack:
    """A gateway with the Batch API, its engine, and two tenants' keys."""

    base_url: str
    app: FastAPI
    engine: FakeEngine
    keys: Keys
    settings: Settings
    alice: str
    bob: str

    def client(self, key: str | None = None) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1", api_key=key or self.alice, max_retries=0
        )

    @property
    def runner(self) -> BatchRunner:
        return self.app.state.services.batch_runner  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
async def stack(redis_url: str, model_path: str) -> AsyncIterator[Stack]:
    settings = gateway_settings(redis_url, model_path, auth="keys", auth_cache_s=0)
    keys = Keys(settings.namespace)
    from cluster.runtime.redis_client import connect

    admin = connect(redis_url)
    api_keys = ApiKeys(admin, keys)
    alice, _ = await api_keys.create("alice")
    bob, _ = await api_keys.create("bob")
    await admin.aclose()
    engine = FakeEngine(max_slots=8, delay_s=0.001)
    async with backend(redis_url, keys, engine), batch_gateway(settings) as (url, app):
        yield Stack(url, app, engine, keys, settings, alice, bob)


async def submit(client: openai.AsyncOpenAI, data: bytes) -> Any:
    file = await client.files.create(file=("input.jsonl", data), purpose="batch")
    assert file.purpose == "batch" and file.bytes == len(data)
    return await client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


async def wait_status(
    client: openai.AsyncOpenAI, batch_id: str, *statuses: str, timeout_s: float = 30
) -> Any:
    found: dict[str, Any] = {}

    async def done() -> bool:
        found["batch"] = await client.batches.retrieve(batch_id)
        return bool(found["batch"].status in statuses)

    await eventually(done, timeout_s=timeout_s, every_s=0.05)
    return found["batch"]


async def read_jsonl(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(x) for x in content.text.splitlines() if x]


# -- parsing (no server) -------------------------------------------------------------


def test_parse_input_reports_bad_lines_by_line_number() -> None:
    data = jsonl(
        [
            line("a"),
            "",
            "{not json",
            json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}),
            line("b").replace("/v1/chat/completions", "/v1/embeddings"),
            json.dumps({"custom_id": "c", "method": "GET", "url": "/v1/chat/completions"}),
            json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/chat/completions"}),
        ]
    )
    parsed = parse_input(data, max_lines=100)
    assert parsed.fatal == []
    assert [(x.index, x.line_no, x.error_code) for x in parsed.lines] == [
        (0, 1, None),
        (1, 3, "invalid_json_line"),
        (2, 4, "missing_custom_id"),
        (3, 5, "invalid_url"),
        (4, 6, "invalid_method"),
        (5, 7, "invalid_body"),
    ]


def test_parse_input_refuses_duplicates_empty_files_and_too_many_lines() -> None:
    dup = parse_input(jsonl([line("a"), line("b"), line("a")]), max_lines=100)
    assert [(e["code"], e["line"]) for e in dup.fatal] == [("duplicate_custom_id", 3)]
    assert parse_input(b"\n\n", max_lines=100).fatal[0]["code"] == "empty_file"
    assert parse_input(b"\xff\xfe", max_lines=100).fatal[0]["code"] == "invalid_file"
    many = parse_input(jsonl([line(str(i)) for i in range(5)]), max_lines=4)
    assert many.fatal[0]["code"] == "too_many_requests"


# -- the API -------------------------------------------------------------------------


async def test_batch_completes_with_output_and_error_files(stack: Stack) -> None:
    good = [line(f"req-{i}", max_tokens=i + 1) for i in range(5)]
    lines = [
        good[0],
        "{not json",
        good[1],
        json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}),
        "",  # blank lines are skipped but still counted as lines
        good[2],
        line("wrong-url").replace("/v1/chat/completions", "/v1/embeddings"),
        line("unknown-model", model="gpt-nope"),
        line("too-long", messages=[{"role": "user", "content": "word " * 2000}]),
        line("bad-type", max_tokens="many"),
        line("unknown-character", character_id="char_missing"),
        good[3],
        good[4],
    ]
    async with stack.client() as client:
        batch = await submit(client, jsonl(lines))
        assert batch.status == "validating"
        assert batch.expires_at - batch.created_at == 24 * 3600
        done = await wait_status(client, batch.id, "completed", "failed")
        assert done.status == "completed", done
        assert done.request_counts.total == 12
        assert done.request_counts.completed == 5
        assert done.request_counts.failed == 7
        for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
            assert getattr(done, stamp) is not None, stamp
        output = await read_jsonl(client, done.output_file_id)
        errors = await read_jsonl(client, done.error_file_id)
        listed = await client.batches.list()
        assert done.id in [b.id for b in listed.data]
    # Output: the good lines, in input order, each with its own reply.
    assert [o["custom_id"] for o in output] == [f"req-{i}" for i in range(5)]
    for i, out in enumerate(output):
        assert out["error"] is None and out["id"].startswith("batch_req_")
        response = out["response"]
        assert response["status_code"] == 200 and response["request_id"]
        body = response["body"]
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == expected(i + 1)
        assert body["usage"]["completion_tokens"] == i + 1
    # Errors: every bad line with its line number and reason; the rest went on.
    by_line = {e["line"]: e for e in errors}
    assert sorted(by_line) == [2, 4, 7, 8, 9, 10, 11]
    assert by_line[2]["error"]["code"] == "invalid_json_line"
    assert by_line[2]["response"] is None and by_line[2]["custom_id"] is None
    assert by_line[4]["error"]["code"] == "missing_custom_id"
    assert by_line[7]["error"]["code"] == "invalid_url"
    assert by_line[7]["custom_id"] == "wrong-url"

    def api_error(n: int) -> tuple[int, str]:
        assert by_line[n]["error"] is None
        response = by_line[n]["response"]
        return response["status_code"], response["body"]["error"]["code"]

    assert api_error(8) == (404, "model_not_found")
    assert api_error(9) == (400, "context_length_exceeded")
    assert api_error(10) == (400, "invalid_value")
    assert api_error(11) == (404, "character_not_found")


async def test_working_keys_are_removed_when_a_batch_finishes(
    stack: Stack, redis: aioredis.Redis
) -> None:
    async with stack.client() as client:
        batch = await submit(client, jsonl([line("only")]))
        await wait_status(client, batch.id, "completed")
    k = stack.keys
    for key in (
        k.batch_input("alice", batch.id),
        k.batch_results("alice", batch.id),
        k.batch_leases("alice", batch.id),
        k.batch_owners("alice", batch.id),
    ):
        assert not await redis.exists(key), key
    assert b"alice/" + batch.id.encode() not in await redis.smembers(k.batch_active)


async def test_a_duplicate_custom_id_fails_validation(stack: Stack) -> None:
    async with stack.client() as client:
        batch = await submit(client, jsonl([line("a"), line("b"), line("a")]))
        failed = await wait_status(client, batch.id, "failed", "completed")
    assert failed.status == "failed" and failed.failed_at is not None
    assert failed.errors is not None
    error = failed.errors.data[0]
    assert (error.code, error.line) == ("duplicate_custom_id", 3)
    assert failed.output_file_id is None
    assert stack.engine.jobs.get("a") is None


async def test_bad_uploads_and_batch_parameters_are_refused(stack: Stack) -> None:
    headers = {"Authorization": f"Bearer {stack.alice}"}
    async with httpx.AsyncClient(base_url=stack.base_url, headers=headers, timeout=30) as http:
        wrong_purpose = await http.post(
            "/v1/files", files={"file": ("x.jsonl", b"{}")}, data={"purpose": "fine-tune"}
        )
        assert wrong_purpose.status_code == 400
        assert wrong_purpose.json()["error"]["param"] == "purpose"
        not_multipart = await http.post("/v1/files", json={"purpose": "batch"})
        assert not_multipart.status_code == 400
        too_big = await http.post(
            "/v1/files",
            files={"file": ("x.jsonl", b"x" * (int(FAST["batch_max_file_bytes"]) + 1))},
            data={"purpose": "batch"},
        )
        assert too_big.status_code == 413
        file_id = (
            await http.post(
                "/v1/files",
                files={"file": ("x.jsonl", jsonl([line("a")]))},
                data={"purpose": "batch"},
            )
        ).json()["id"]
        base = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
        for body, param in (
            ({**base, "completion_window": "1h"}, "completion_window"),
            ({**base, "endpoint": "/v1/embeddings", "completion_window": "24h"}, "endpoint"),
        ):
            resp = await http.post("/v1/batches", json=body)
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["param"] == param
        missing = await http.post(
            "/v1/batches", json={**base, "input_file_id": "file-nope", "completion_window": "24h"}
        )
        assert missing.status_code == 404
        assert (await http.get("/v1/batches/batch_nope")).status_code == 404
        # Deleting the input file does not strand a batch made from it.
        made = await http.post("/v1/batches", json={**base, "completion_window": "24h"})
        assert made.status_code == 200
        assert (await http.delete(f"/v1/files/{file_id}")).json()["deleted"] is True
        assert (await http.get(f"/v1/files/{file_id}")).status_code == 404
    async with stack.client() as client:
        done = await wait_status(client, made.json()["id"], "completed", "failed")
        assert done.status == "completed" and done.request_counts.completed == 1


async def test_tenants_see_only_their_own_files_and_batches(stack: Stack) -> None:
    async with stack.client(stack.alice) as alice, stack.client(stack.bob) as bob:
        batch = await submit(alice, jsonl([line("mine")]))
        done = await wait_status(alice, batch.id, "completed")
        for call in (
            bob.batches.retrieve(batch.id),
            bob.batches.cancel(batch.id),
            bob.files.retrieve(batch.input_file_id),
            bob.files.content(batch.input_file_id),
            bob.files.content(done.output_file_id),
            bob.batches.create(
                input_file_id=batch.input_file_id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
            ),
        ):
            with pytest.raises(openai.NotFoundError):
                await call
        assert batch.id not in [b.id for b in (await bob.batches.list()).data]
        assert batch.input_file_id not in [f.id for f in (await bob.files.list()).data]
        assert batch.input_file_id in [f.id for f in (await alice.files.list()).data]


async def test_listing_pages_newest_first(stack: Stack) -> None:
    async with stack.client() as client:
        made = [(await submit(client, jsonl([line(f"p{i}")]))).id for i in range(3)]
        page = await client.batches.list(limit=2)
        assert [b.id for b in page.data] == [made[2], made[1]]
        assert page.has_more is True
        rest = await client.batches.list(limit=2, after=made[1])
        assert rest.data[0].id == made[0]
        for batch_id in made:
            await wait_status(client, batch_id, "completed")


async def test_cancel_stops_running_lines_and_keeps_what_finished(stack: Stack) -> None:
    engine = stack.engine
    async with stack.client() as client:
        first = await submit(client, jsonl([line("early", max_tokens=1)]))
        await wait_status(client, first.id, "completed")
        engine.release.clear()  # from here on, every reply hangs
        try:
            before = set(engine.started)
            batch = await submit(client, jsonl([line(f"c{i}", max_tokens=3) for i in range(6)]))
            await wait_status(client, batch.id, "in_progress")
            await engine.wait_until(lambda: engine.running >= 6)
            running = [j for j in engine.started if j not in before]
            cancelled = await client.batches.cancel(batch.id)
            assert cancelled.status in ("cancelling", "cancelled")
            assert cancelled.cancelling_at is not None
            done = await wait_status(client, batch.id, "cancelled")
            # Every line that was running was aborted in the engine.
            await engine.wait_until(lambda: engine.running == 0)
            assert len(running) == 6 and set(running) <= set(engine.aborted)
        finally:
            engine.release.set()
        assert done.cancelled_at is not None
        assert done.request_counts.total == 6 and done.request_counts.completed == 0
        errors = await read_jsonl(client, done.error_file_id)
        assert sorted(e["custom_id"] for e in errors) == [f"c{i}" for i in range(6)]
        assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
        with pytest.raises(openai.APIStatusError) as refused:
            await client.batches.cancel(first.id)  # completed: nothing to cancel
        assert refused.value.status_code == 409


async def test_an_expired_batch_stops_and_reports_the_rest(
    stack: Stack, redis: aioredis.Redis
) -> None:
    engine = stack.engine
    async with stack.client() as client:
        engine.release.clear()
        try:
            batch = await submit(client, jsonl([line(f"x{i}") for i in range(3)]))
            await wait_status(client, batch.id, "in_progress")
            await engine.wait_until(lambda: engine.running >= 3)
            key = stack.keys.batch_object("alice", batch.id)
            await redis.hset(key, "expires_at", int(time.time()) - 1)
            done = await wait_status(client, batch.id, "expired")
            await engine.wait_until(lambda: engine.running == 0)
        finally:
            engine.release.set()
        assert done.expired_at is not None
        assert done.request_counts.failed == 3 and done.request_counts.completed == 0
        errors = await read_jsonl(client, done.error_file_id)
        assert [e["error"]["code"] for e in errors] == ["batch_expired"] * 3
        assert [e["line"] for e in errors] == [1, 2, 3]


async def test_a_line_whose_lease_lapses_is_taken_over_and_runs_once(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stalled owner (here: renewals stop) loses its lines; the next claim cancels the
    job it left behind and runs the line again; only one result is ever recorded."""
    engine = stack.engine
    store = stack.runner._store

    async def no_renewal(*args: Any, **kwargs: Any) -> list[int]:
        return []

    async with stack.client() as client:
        engine.release.clear()
        try:
            monkeypatch.setattr(store, "renew", no_renewal)
            before = set(engine.started)
            batch = await submit(client, jsonl([line(f"l{i}", max_tokens=2) for i in range(2)]))
            await wait_status(client, batch.id, "in_progress")
            await engine.wait_until(lambda: engine.running >= 2)
            stale = [j for j in engine.started if j not in before]
            assert len(stale) == 2
            # Past the lease, the lines are claimed again and the old jobs aborted.
            await engine.wait_until(lambda: set(stale) <= set(engine.aborted), timeout_s=10)
            monkeypatch.undo()
            await engine.wait_until(lambda: engine.running >= 2)
        finally:
            engine.release.set()
        done = await wait_status(client, batch.id, "completed")
        output = await read_jsonl(client, done.output_file_id)
    assert done.request_counts.completed == 2 and done.request_counts.failed == 0
    assert [o["custom_id"] for o in output] == ["l0", "l1"]
    assert all(o["response"]["request_id"] not in stale for o in output)


async def test_queue_full_refusals_are_retried_not_failed(redis_url: str, model_path: str) -> None:
    settings = gateway_settings(redis_url, model_path, max_queued=2)
    keys = Keys(settings.namespace)
    engine = FakeEngine(max_slots=1, delay_s=0.03)
    async with (
        backend(redis_url, keys, engine),
        batch_gateway(settings, batch_max_in_flight=8) as (url, app),
    ):
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            batch = await submit(client, jsonl([line(f"q{i}", max_tokens=3) for i in range(16)]))
            done = await wait_status(client, batch.id, "completed", timeout_s=60)
            output = await read_jsonl(client, done.output_file_id)
        metrics = app.state.services.metrics
    assert done.request_counts.completed == 16 and done.request_counts.failed == 0
    assert [o["custom_id"] for o in output] == [f"q{i}" for i in range(16)]
    # Some tries really were refused with queue_full (and retried).
    refused = metrics.registry.get_sample_value(
        "charserve_admission_total",
        {"priority": "batch", "decision": "rejected", "reason": "queue_full"},
    )
    assert refused is not None and refused > 0


async def test_a_batch_survives_a_gateway_restart(redis_url: str, model_path: str) -> None:
    first = gateway_settings(redis_url, model_path)
    second = first.model_copy(update={"port": free_port()})
    keys = Keys(first.namespace)
    engine = FakeEngine(max_slots=2, delay_s=0.03)
    lines = [line(f"r{i}", max_tokens=1 + i % 3) for i in range(12)]
    async with backend(redis_url, keys, engine):
        async with batch_gateway(first) as (url, _):
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x") as client:
                batch = await submit(client, jsonl(lines))

                async def some_done() -> bool:
                    state = await client.batches.retrieve(batch.id)
                    return state.request_counts.completed >= 3

                await eventually(some_done, timeout_s=30)
        # The first gateway is gone mid-batch.
        async with batch_gateway(second) as (url, _):
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x") as client:
                stopped = await client.batches.retrieve(batch.id)
                assert stopped.status == "in_progress"
                assert 3 <= stopped.request_counts.completed < 12
                done = await wait_status(client, batch.id, "completed", timeout_s=60)
                output = await read_jsonl(client, done.output_file_id)
    assert done.request_counts.completed == 12 and done.request_counts.failed == 0
    assert [o["custom_id"] for o in output] == [f"r{i}" for i in range(12)]
    for i, out in enumerate(output):
        assert out["response"]["body"]["choices"][0]["message"]["content"] == expected(1 + i % 3)


async def test_two_gateways_share_a_batch_and_run_each_line_once(
    redis_url: str, model_path: str
) -> None:
    one = gateway_settings(redis_url, model_path)
    two = one.model_copy(update={"port": free_port()})
    keys = Keys(one.namespace)
    engine = FakeEngine(max_slots=8, delay_s=0.02)
    config = {"batch_max_in_flight": 6, "batch_max_in_flight_per_gateway": 3}
    async with (
        backend(redis_url, keys, engine),
        batch_gateway(one, **config) as (url, _),
        batch_gateway(two, **config),
    ):
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x") as client:
            batch = await submit(client, jsonl([line(f"s{i}", max_tokens=3) for i in range(20)]))
            done = await wait_status(client, batch.id, "completed", timeout_s=60)
            output = await read_jsonl(client, done.output_file_id)
    assert done.request_counts.completed == 20
    assert [o["custom_id"] for o in output] == [f"s{i}" for i in range(20)]
    started = [engine.jobs[j] for j in engine.started]
    assert len(started) == 20  # no line ran twice
    assert len({job.reply_to for job in started}) == 2  # both gateways did some
    assert engine.max_running_seen <= 6  # the batch's bound holds across gateways


async def test_a_batch_of_text_completions(stack: Stack) -> None:
    def text_line(custom_id: str, **body: Any) -> str:
        request = {"model": MODEL, "prompt": f"Once, {custom_id}", "max_tokens": 3, **body}
        return json.dumps(
            {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": request}
        )

    lines = [text_line("a"), text_line("b", suffix="!"), line("chat-in-a-text-batch")]
    async with stack.client() as client:
        file = await client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
        batch = await client.batches.create(
            input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
        )
        assert batch.endpoint == "/v1/completions"
        done = await wait_status(client, batch.id, "completed", "failed")
        output = await read_jsonl(client, done.output_file_id)
        errors = await read_jsonl(client, done.error_file_id)
    assert [o["custom_id"] for o in output] == ["a"]
    body = output[0]["response"]["body"]
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == expected(3)
    # A refused field fails its line; a line for another endpoint fails validation.
    assert {e["custom_id"] for e in errors} == {"b", "chat-in-a-text-batch"}


async def test_a_line_may_ask_for_several_choices(stack: Stack) -> None:
    async with stack.client() as client:
        batch = await submit(client, jsonl([line("two", max_tokens=2, n=2)]))
        done = await wait_status(client, batch.id, "completed", "failed")
        assert done.status == "completed" and done.request_counts.completed == 1, done
        (out,) = await read_jsonl(client, done.output_file_id)
    body = out["response"]["body"]
    assert [(c["index"], c["message"]["content"]) for c in body["choices"]] == [
        (0, expected(2)),
        (1, expected(2)),
    ]
    assert body["usage"]["completion_tokens"] == 4
