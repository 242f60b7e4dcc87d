"""The roleplay samplers' fields at the gateway (DRY, XTC, banned strings): checked with a
400 naming the field, and carried in the job's sampling as the worker reads them, for
chats, text completions and the Batch API's lines alike."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from gateway.chat.schemas import ChatCompletionRequest, CompletionRequest
from tests.gateway.conftest import Gateway
from tests.gateway.test_chat import MESSAGES, MODEL, job_id
from tests.polling import eventually

ALL_FIELDS: dict[str, Any] = {
    "dry_multiplier": 0.8,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": 1024,
    "dry_sequence_breakers": ["\n", ":", '"', "*"],
    "xtc_threshold": 0.1,
    "xtc_probability": 0.5,
    "banned_strings": ["Mira", "shivers down"],
}


@pytest.fixture(autouse=True)
async def ready(http: httpx.AsyncClient) -> None:
    async def is_ready() -> bool:
        return (await http.get("/ready")).status_code == 200

    await eventually(is_ready, timeout_s=10)


async def _sampling(
    http: httpx.AsyncClient, gateway: Gateway, path: str = "/v1/chat/completions", **fields: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1, **fields}
    if path == "/v1/chat/completions":
        body["messages"] = MESSAGES
    else:
        body["prompt"] = "Captain Mira Vance said"
    resp = await http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    key = str(resp.json()["id"]).removeprefix("cmpl-")
    return gateway.engine.jobs[job_id(resp) if path.endswith("chat/completions") else key].sampling


async def test_the_fields_ride_in_the_jobs_sampling(
    http: httpx.AsyncClient, gateway: Gateway
) -> None:
    assert await _sampling(http, gateway, **ALL_FIELDS) == ALL_FIELDS
    text = await _sampling(http, gateway, "/v1/completions", **ALL_FIELDS)
    assert text == ALL_FIELDS


async def test_the_other_forms_frontends_send_become_lists(
    http: httpx.AsyncClient, gateway: Gateway
) -> None:
    sampling = await _sampling(
        http,
        gateway,
        # text-generation-webui's (and TabbyAPI's) one string, and one banned string.
        dry_multiplier=1.0,
        dry_sequence_breakers='"\\n", ":", "\\"", "*"',
        banned_strings="Mira",
    )
    assert sampling["dry_sequence_breakers"] == ["\n", ":", '"', "*"]
    assert sampling["banned_strings"] == ["Mira"]
    bracketed = await _sampling(http, gateway, dry_sequence_breakers='["\\n"]')
    assert bracketed["dry_sequence_breakers"] == ["\n"]


async def test_without_the_fields_the_job_carries_none(
    http: httpx.AsyncClient, gateway: Gateway
) -> None:
    sampling = await _sampling(http, gateway, temperature=0.5, dry_multiplier=None)
    assert sampling == {"temperature": 0.5}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dry_multiplier", -0.1),
        ("dry_multiplier", "0.8"),
        ("dry_multiplier", True),
        ("dry_multiplier", 1e400),  # JSON's 1e400 is infinity
        ("dry_base", 1.0),
        ("dry_base", 0.5),
        ("dry_allowed_length", 0),
        ("dry_allowed_length", 51),
        ("dry_allowed_length", 2.5),
        ("dry_penalty_last_n", -2),
        ("dry_penalty_last_n", 2**64),
        ("dry_sequence_breakers", [""]),
        ("dry_sequence_breakers", ["x" * 33]),
        ("dry_sequence_breakers", [str(i) for i in range(17)]),
        ("dry_sequence_breakers", [1]),
        ("dry_sequence_breakers", "not json"),
        ("dry_sequence_breakers", '"a", 1'),
        ("dry_sequence_breakers", '"' + "x" * 2000 + '"'),
        ("xtc_threshold", -0.1),
        ("xtc_threshold", 0.51),
        ("xtc_probability", 1.01),
        ("xtc_probability", -1),
        ("banned_strings", ""),
        ("banned_strings", [""]),
        ("banned_strings", ["x" * 257]),
        ("banned_strings", [f"w{i}" for i in range(65)]),
        ("banned_strings", ["\ud800"]),
        ("banned_strings", {"a": 1}),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_bad_values_are_a_400_naming_the_field(
    http: httpx.AsyncClient, path: str, field: str, value: Any
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1, field: value}
    body |= {"messages": MESSAGES} if path.endswith("chat/completions") else {"prompt": "Hi"}
    content = json.dumps(body).replace("Infinity", "1e400").encode()
    resp = await http.post(path, content=content, headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field or error["param"].startswith(field + "."), error
    assert error["code"] == "invalid_value"


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_batch_lines_take_the_same_fields(model: type[Any]) -> None:
    """The Batch API checks each line's body with these same classes (gateway/batches)."""
    body: dict[str, Any] = {"model": MODEL, **ALL_FIELDS}
    body |= {"messages": MESSAGES} if model is ChatCompletionRequest else {"prompt": "Hi"}
    assert model.model_validate(body).sampling() == ALL_FIELDS
