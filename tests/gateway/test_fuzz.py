"""Schemathesis against the gateway's own OpenAPI document: no 5xx, and every response
(status, media type, body, headers) is one the document declares.

The gateway is real (uvicorn on 127.0.0.1, real Redis, a consumer driving the FakeEngine)
but served from a thread with its own event loop: Schemathesis calls it synchronously,
which would block a server on the test's own loop.

Cases are generated from the document (positive and negative, every operation) and a
part of them is aimed at things that exist, the served model, a character, a session, a
finished completion, so fuzzing gets past the 404s into the routes' own logic. Generation
is deterministic and bounded (``MAX_EXAMPLES`` per operation, no example database).
"""

from __future__ import annotations

import asyncio
import json
import threading
import zlib
from collections.abc import Coroutine, Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from unittest import mock

import httpx
import pytest
import requests
import schemathesis
from pydantic import ValidationError
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from cluster.runtime.redis_client import connect
from cluster.runtime.settings import Settings
from cluster.wire.keys import Keys
from cluster.wire.tenants import ApiKeys
from gateway.chat.responses import ChatCompletionChunk
from gateway.http.auth import needs_key
from gateway.http.openapi import ErrorBody
from tests.fakes import FakeEngine
from tests.gateway.conftest import gateway_settings, serve_gateway
from workers.loop.config import ConsumerConfig
from workers.loop.consumer import Consumer

MODEL = "smollm2-135m-instruct"
MAX_EXAMPLES = 25
CONFIG: dict[str, Any] = {
    "suppress-health-check": ["all"],  # a real server over HTTP is "too slow" for Hypothesis
    "generation": {
        "max-examples": MAX_EXAMPLES,
        "deterministic": True,  # the same cases every run: a failure reproduces
        "database": "none",  # and no .hypothesis folder in the repository
    },
    # One request at a time: the stateful phase needs links the document does not have.
    "phases": {"stateful": {"enabled": False}},
}
T = TypeVar("T")


def sse_events_are_openai_chunks(ctx: Any, response: Any, case: Any) -> bool | None:
    """A text/event-stream reply is chat.completion.chunk events (or an error event),
    ending with ``data: [DONE]``."""
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return None
    datas = [
        "\n".join(line[6:] for line in block.split("\n") if line.startswith("data: "))
        for block in response.content.decode().split("\n\n")
        if block.strip()
    ]
    assert datas and datas[-1] == "[DONE]", f"the stream does not end with [DONE]: {datas[-3:]}"
    ids = set()
    for data in datas[:-1]:
        body = json.loads(data)
        try:
            if "error" in body:
                ErrorBody.model_validate(body)
            else:
                ids.add(ChatCompletionChunk.model_validate(body).id)
        except ValidationError as exc:
            raise AssertionError(f"an SSE event is not a chunk or an error: {exc}") from None
    assert len(ids) <= 1, f"chunks of one stream carry different ids: {ids}"
    return True


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


@dataclass
class Served:
    """A gateway served from its own thread and event loop, with what the fuzzer aims at."""

    base_url: str
    settings: Settings
    loop: asyncio.AbstractEventLoop
    session: requests.Session
    character_id: str = ""
    session_id: str = ""
    completion_id: str = ""

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the gateway's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def create(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> str:
        """POST ``body`` to ``path``; the new resource's id."""
        resp = self.session.post(f"{self.base_url}{path}", json=body, headers=headers, timeout=30)
        assert resp.status_code == 200, resp.text
        return str(resp.json()["id"])


@contextmanager
def served(redis_url: str, settings: Settings) -> Iterator[Served]:
    """Serve a gateway (and a FakeEngine consumer) from a thread until the block ends."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzz-gateway", daemon=True)
    thread.start()
    stack = AsyncExitStack()

    async def start() -> str:
        # Tiny replies: a generated max_tokens never keeps the engine busy for long.
        engine = FakeEngine(max_slots=8, delay_s=0.0005)
        consumer = Consumer(
            redis_url,
            Keys(settings.namespace),
            engine,
            ConsumerConfig(heartbeat_ms=200, batch_reserve_slots=0),
        )
        await consumer.start()
        stack.push_async_callback(consumer.close)
        stack.callback(engine.release.set)
        return await stack.enter_async_context(serve_gateway(settings))

    session = requests.Session()
    try:
        base_url = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=60)
        gateway = Served(base_url, settings, loop, session)
        with httpx.Client(base_url=base_url, timeout=5) as http:  # until a worker is seen
            for _ in range(100):
                if http.get("/ready").status_code == 200:
                    break
                threading.Event().wait(0.1)
        yield gateway
    finally:
        session.close()
        asyncio.run_coroutine_threadsafe(stack.aclose(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def fuzz_settings(redis_url: str, model_path: str, **overrides: object) -> Settings:
    """A small window and short replies, so no generated request runs long."""
    values: dict[str, object] = {
        "max_model_len": 256,
        "default_max_tokens": 8,
        "max_completion_tokens": 64,
        "request_timeout_s": 5,
        "max_body_bytes": 256 * 1024,
        "max_messages": 16,
    }
    return gateway_settings(redis_url, model_path, **(values | overrides))


@pytest.fixture(scope="module")
def open_gateway(redis_url: str, model_path: str) -> Iterator[Served]:
    """A gateway without API keys, with a character, a session and a finished reply."""
    with served(redis_url, fuzz_settings(redis_url, model_path)) as gateway:
        card = {"name": "Nyx", "description": "a quiet owl", "first_mes": "Hoo, {{user}}."}
        gateway.character_id = gateway.create("/v1/characters", card, {})
        gateway.session_id = gateway.create(
            "/v1/sessions", {"character_id": gateway.character_id}, {}
        )
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        gateway.completion_id = gateway.create("/v1/chat/completions", body, {})
        yield gateway


@pytest.fixture(scope="module")
def keyed_gateway(redis_url: str, model_path: str) -> Iterator[Served]:
    """A gateway that needs API keys, whose namespace has one (and no lookup cache)."""
    settings = fuzz_settings(redis_url, model_path, auth_cache_s=0, auth="keys")
    with served(redis_url, settings) as gateway:

        async def make_key() -> None:
            client = connect(redis_url)
            try:
                await ApiKeys(client, Keys(settings.namespace)).create("fuzz")
            finally:
                await client.aclose()

        gateway.run(make_key())
        yield gateway


def _document() -> dict[str, Any]:
    """The app's OpenAPI document. Building the app needs no Redis (its lifespan does), and
    collecting this module configures no logging."""
    from gateway.app import create_app

    with mock.patch("gateway.app.configure_logging"):
        return create_app(Settings(log_format="console")).openapi()


def _schema(max_examples: int) -> schemathesis.BaseSchema:
    config = CONFIG | {"generation": CONFIG["generation"] | {"max-examples": max_examples}}
    # Loaded at import: schemathesis.pytest.from_fixture (lazy loading) does not work with
    # pytest 9.2 yet. The served document is checked to be this one.
    return schemathesis.openapi.from_dict(_document(), config=schemathesis.Config.from_dict(config))


DOCUMENT = _document()
open_api = _schema(MAX_EXAMPLES)
keyed_api = _schema(5)

ROUTES = {
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/chat/completions/{completion_id}/events"),
    ("GET", "/v1/models"),
    ("POST", "/v1/characters"),
    ("GET", "/v1/characters"),
    ("GET", "/v1/characters/{character_id}"),
    ("DELETE", "/v1/characters/{character_id}"),
    ("POST", "/v1/sessions"),
    ("GET", "/v1/sessions/{session_id}"),
    ("DELETE", "/v1/sessions/{session_id}"),
    ("GET", "/health"),
    ("GET", "/ready"),
}


def test_the_document_is_honest_about_errors(open_gateway: Served) -> None:
    """Every route is documented with the errors it answers, as OpenAI error bodies;
    none with FastAPI's 422 (this gateway answers 400 for a request it cannot parse)."""
    raw = open_gateway.session.get(f"{open_gateway.base_url}/openapi.json", timeout=30).json()
    assert raw == DOCUMENT
    documented = {
        (method.upper(), path): operation
        for path, item in raw["paths"].items()
        for method, operation in item.items()
    }
    assert documented.keys() >= ROUTES
    error_ref = "#/components/schemas/ErrorBody"
    for (method, path), operation in documented.items():
        responses = operation["responses"]
        assert "422" not in responses, (method, path)
        assert "200" in responses and "413" in responses, (method, path)
        if path.startswith("/v1/"):
            assert {"401", "503"} <= responses.keys(), (method, path)
        for status, response in responses.items():
            assert "x-request-id" in response.get("headers", {}), (method, path, status)
            if status in ("400", "401", "404", "413", "429", "504"):
                schema = response["content"]["application/json"]["schema"]
                assert schema == {"$ref": error_ref}, (method, path, status)
    chat = documented["POST", "/v1/chat/completions"]["responses"]
    assert {"400", "404", "429", "503", "504"} <= chat.keys()
    assert {"application/json", "text/event-stream"} <= chat["200"]["content"].keys()
    events = documented["GET", "/v1/chat/completions/{completion_id}/events"]["responses"]
    assert list(events["200"]["content"]) == ["text/event-stream"]


def _pick(case: schemathesis.Case, salt: str, one_in: int = 2) -> bool:
    """A deterministic coin for this case (Hypothesis drew the case; this only aims it)."""
    seed = repr((salt, case.path_parameters, case.body, case.headers)).encode()
    return zlib.crc32(seed) % one_in == 0


def _aim(case: schemathesis.Case, gateway: Served) -> None:
    """Point part of the cases at the served model and at things that exist."""
    params = case.path_parameters or {}
    body = case.body if isinstance(case.body, dict) else None
    path, method = case.operation.path, case.method.upper()
    if "character_id" in params and _pick(case, "character"):
        params["character_id"] = (
            gateway.create("/v1/characters", {"name": "Tmp"}, {})
            if method == "DELETE"
            else gateway.character_id
        )
    if "session_id" in params and _pick(case, "session"):
        params["session_id"] = (
            gateway.create("/v1/sessions", {"character_id": gateway.character_id}, {})
            if method == "DELETE"
            else gateway.session_id
        )
    if "completion_id" in params and _pick(case, "completion"):
        params["completion_id"] = gateway.completion_id
    if case.headers and "X-Latency-Budget-Ms" in case.headers and not _pick(case, "budget", 4):
        del case.headers["X-Latency-Budget-Ms"]  # most generated budgets are too short to meet
    if body is None:
        return
    if path == "/v1/characters" and case.media_type == "application/json" and _pick(case, "card"):
        # A V1 card of the generated text fields (typed card fields may have any shape).
        text = {k: v for k, v in body.items() if isinstance(v, str) and not k.startswith("spec")}
        body.clear()
        body.update(text, name="Fuzz")
    if path == "/v1/sessions" and "character_id" in body and _pick(case, "greet"):
        body["character_id"] = gateway.character_id
    if path == "/v1/chat/completions" and "model" in body and not _pick(case, "model", 4):
        body["model"] = MODEL
        if _pick(case, "stream", 3):
            body["stream"] = True
        if _pick(case, "persona", 3):
            body["character_id"] = gateway.character_id
        elif _pick(case, "turn", 3):
            body["session_id"] = gateway.session_id


@open_api.parametrize()
def test_fuzz_open_gateway(case: schemathesis.Case, open_gateway: Served) -> None:
    """No 5xx; every status, media type, body and header as documented."""
    _aim(case, open_gateway)
    case.call_and_validate(
        base_url=open_gateway.base_url,
        session=open_gateway.session,
        checks=CHECKS,
        additional_checks=[sse_events_are_openai_chunks],
        timeout=15,
    )


@keyed_api.parametrize()
def test_fuzz_without_a_key(case: schemathesis.Case, keyed_gateway: Served) -> None:
    """Once keys exist, every /v1 route (and the token routes) answers a documented 401 to
    a caller without one (or with a wrong one); the probes stay open."""
    response = case.call_and_validate(
        base_url=keyed_gateway.base_url, session=keyed_gateway.session, checks=CHECKS, timeout=15
    )
    if case.method.upper() != case.operation.method.upper():
        return  # an undocumented method (the coverage phase tries them): 401 or 405
    if needs_key(case.operation.path):
        assert response.status_code in (401, 413), response.text
        if response.status_code == 401:
            assert response.json()["error"]["code"] == "invalid_api_key"
    else:
        assert response.status_code == 200, response.text


def _chat(**extra: Any) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return json.dumps(body | extra).encode()


LONE_SURROGATE = '"\\ud800"'  # JSON for a string UTF-8 cannot encode
FIXED = [
    # (name, method, path, body, headers, status, param)
    ("seed beyond 64 bits", "POST", "/v1/chat/completions", _chat(seed=2**70), {}, 400, "seed"),
    ("negative seed", "POST", "/v1/chat/completions", _chat(seed=-(2**70)), {}, 400, "seed"),
    ("huge extra", "POST", "/v1/chat/completions", _chat(foo=[2**64]), {}, 400, "foo"),
    ("huge top_k", "POST", "/v1/chat/completions", _chat(top_k=2**64), {}, 400, "top_k"),
    (
        "huge logit_bias key",
        "POST",
        "/v1/chat/completions",
        _chat(logit_bias={"9" * 30: 1.0}),
        {},
        400,
        "logit_bias",
    ),
    (
        "superscript logit_bias key",
        "POST",
        "/v1/chat/completions",
        _chat(logit_bias={"\u00b2": 1.0}),
        {},
        400,
        "logit_bias",
    ),
    (
        "lone surrogate in content",
        "POST",
        "/v1/chat/completions",
        _chat().replace(b'"hi"', LONE_SURROGATE.encode()),
        {},
        400,
        "messages.0.content",
    ),
    (
        "lone surrogate in model",
        "POST",
        "/v1/chat/completions",
        _chat().replace(f'"{MODEL}"'.encode(), LONE_SURROGATE.encode()),
        {},
        400,
        "model",
    ),
    (
        "lone surrogate in stop",
        "POST",
        "/v1/chat/completions",
        _chat(stop="x").replace(b'"x"', LONE_SURROGATE.encode()),
        {},
        400,
        "stop",
    ),
    (
        "extra named keys",
        "POST",
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": "hi", "keys": 1.5, "n": 2**64}]),
        {},
        400,
        "messages.0.keys",
    ),
    (
        "bad multipart",
        "POST",
        "/v1/characters",
        b"x",
        {"Content-Type": "multipart/form-data"},
        400,
        None,
    ),
    (
        "budget beyond 64 bits",
        "POST",
        "/v1/chat/completions",
        _chat(),
        {"X-Latency-Budget-Ms": str(10**30)},
        400,
        "X-Latency-Budget-Ms",
    ),
    (
        "lone surrogate in a card",
        "POST",
        "/v1/characters",
        f'{{"name": {LONE_SURROGATE}}}'.encode(),
        {"Content-Type": "application/json"},
        400,
        "name",
    ),
]
# Outside the files this test's author could change: each passes once its cause is fixed
# (then drop it here and add it to FIXED).
NOT_YET_FIXED: list[tuple[tuple[Any, ...], str]] = []


@pytest.mark.parametrize(
    ("name", "method", "path", "body", "headers", "status", "param"),
    [pytest.param(*case, id=case[0]) for case in FIXED]
    + [
        pytest.param(*case, id=case[0], marks=pytest.mark.xfail(strict=True, reason=reason))
        for case, reason in NOT_YET_FIXED
    ],
)
def test_what_fuzzing_found_is_a_4xx(
    open_gateway: Served,
    name: str,
    method: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
    status: int,
    param: str | None,
) -> None:
    """Inputs fuzzing found mishandled (a 500, or a 4xx coded internal_error): refused
    with an OpenAI error naming the field."""
    resp = requests.request(
        method,
        f"{open_gateway.base_url}{path}",
        data=body,
        headers={"Content-Type": "application/json", **headers},
        timeout=30,
    )
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] != "internal_error"
    assert error["param"] == param, error


def test_an_unsupported_method_is_405_with_allow(open_gateway: Served) -> None:
    resp = requests.request("PATCH", f"{open_gateway.base_url}/health", timeout=30)
    assert resp.status_code == 405
    assert resp.headers["allow"] == "GET"
    assert resp.json()["error"]["code"] == "method_not_allowed"
