"""End to end with the real engine: the roleplay samplers (DRY, XTC, banned strings) as
vLLM logits processors in the CPU engine's continuous batching, through the gateway.

Every comparison is against greedy decoding (temperature 0), which is deterministic, so a
sampler's effect is a changed reply, and its absence an identical one."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Stack

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
PERSONA = "You are Captain Mira Vance, captain of the starship Wayfarer. Always stay in character."
WORD_TOKEN = re.compile(r"^ ?[A-Za-z]{3,}$")


@pytest.fixture
async def http(stack: Stack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
        yield client


async def _chat(http: httpx.AsyncClient, question: str, **fields: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": PERSONA},
            {"role": "user", "content": question},
        ],
        "max_tokens": 40,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 0,
        **fields,
    }
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    reply: dict[str, Any] = resp.json()
    return reply


def _text(reply: dict[str, Any]) -> str:
    return str(reply["choices"][0]["message"]["content"])


def _tokens(reply: dict[str, Any]) -> list[str]:
    """The reply's tokens, as the engine emitted them."""
    return [c["token"] for c in reply["choices"][0]["logprobs"]["content"]]


async def _complete(http: httpx.AsyncClient, prompt: str, **fields: Any) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, **fields}
    resp = await http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["text"])


async def _single_token(http: httpx.AsyncClient, text: str) -> bool:
    resp = await http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert resp.status_code == 200, resp.text
    return bool(resp.json()["count"] == 1)


async def test_a_banned_word_greedy_would_say_is_never_emitted(http: httpx.AsyncClient) -> None:
    question = "Introduce yourself and your ship."
    plain = await _chat(http, question)
    tokens = _tokens(plain)
    # The first whole-word token of the greedy reply that is one token on its own.
    banned = None
    for token in tokens:
        if WORD_TOKEN.match(token) and await _single_token(http, token):
            banned = token
            break
    assert banned is not None, tokens
    word = banned.strip()
    guarded = await _chat(http, question, banned_strings=[word])
    # The guarantee: neither of the word's one-token forms is ever emitted.
    emitted = _tokens(guarded)
    assert banned not in emitted and word not in emitted and " " + word not in emitted, emitted
    assert _text(guarded) != _text(plain)
    # Up to the banned token the reply is the same (unless the word came earlier in
    # another tokenization, whose last token is banned too): nothing else was touched.
    cut = tokens.index(banned)
    if word not in "".join(tokens[:cut]):
        assert emitted[:cut] == tokens[:cut]


async def test_dry_breaks_a_repetitive_greedy_continuation(http: httpx.AsyncClient) -> None:
    prompt = "The ship sails at dawn. " * 6 + "The ship sails at"
    plain = await _complete(http, prompt)
    assert plain.startswith(" dawn"), plain  # greedy repeats the line
    dry = await _complete(http, prompt, dry_multiplier=3.0, dry_base=1.75, dry_allowed_length=2)
    # " dawn" would extend a repeat of 50 tokens (no breaker in the prompt): penalized far
    # below every other token.
    assert not dry.startswith(" dawn"), dry
    assert dry != plain
    # Off (multiplier 0) and without the fields: the greedy reply, unchanged.
    assert await _complete(http, prompt, dry_multiplier=0.0, dry_base=1.75) == plain


async def test_xtc_always_on_changes_the_greedy_reply(http: httpx.AsyncClient) -> None:
    question = "Tell me a story about the strangest planet you have visited."
    plain = _text(await _chat(http, question))
    assert _text(await _chat(http, question)) == plain  # greedy is deterministic here
    xtc = _text(await _chat(http, question, xtc_threshold=0.1, xtc_probability=1.0))
    # Some step has two tokens at p >= 0.1: the most likely is excluded.
    assert xtc != plain
    neutral = _text(await _chat(http, question, xtc_threshold=0.1, xtc_probability=0.0))
    assert neutral == plain


async def test_the_samplers_together_and_their_refusals(http: httpx.AsyncClient) -> None:
    reply = await _chat(
        http,
        "Hello!",
        dry_multiplier=0.8,
        dry_sequence_breakers='"\\n", ":", "\\"", "*"',
        xtc_threshold=0.1,
        xtc_probability=0.5,
        banned_strings=["Wayfarer"],
    )
    assert _text(reply)
    for field, value in (("xtc_threshold", 0.7), ("dry_base", 1.0), ("banned_strings", [""])):
        resp = await http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], field: value},
        )
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"].startswith(field)
