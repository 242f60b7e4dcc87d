"""The same request through charserve and through vLLM's own OpenAI server, with the same
model and engine settings: the same prompt tokens, the same greedy text, the same logprobs.

vLLM's server runs beside the session's stack for this module only (the one test on this
machine that needs two engines at once): started with the settings of
``ray-configs/local-cpu.yaml`` (:mod:`workers.baselines.vllm_server`), stopped by its
process group when the module ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cluster.runtime.net import free_port, wait_ready
from tests.e2e.conftest import ROOT, Stack

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
START_TIMEOUT_S = 600
MESSAGES = [
    {"role": "system", "content": "You are Captain Mira Vance of the starship Wayfarer."},
    {"role": "user", "content": "What do you see out of the window, captain?"},
]


@pytest.fixture(scope="module")
def vllm_url() -> Iterator[str]:
    """vLLM's own server with the e2e stack's engine settings, ready to serve."""
    from workers.baselines.vllm_server import command, engine_config_from

    config = engine_config_from(ROOT / "ray-configs" / "local-cpu.yaml")
    port = free_port()
    log_path = Path(tempfile.mkdtemp(prefix="vllm-parity-")) / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command(config, "127.0.0.1", port),
            cwd=ROOT,
            env={**os.environ, **config.env()},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its engine process too is stopped by the group
        )
    try:
        _wait_healthy(proc, f"http://127.0.0.1:{port}/health", log_path)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
    try:
        wait_ready(url, proc, START_TIMEOUT_S)
    except (RuntimeError, TimeoutError) as exc:
        raise RuntimeError(f"{exc}; vLLM's server log:\n{log_path.read_text()[-4000:]}") from exc


def _post(base_url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{base_url}{path}", json=body, timeout=120)
    assert resp.status_code == 200, (base_url, resp.text)
    return resp.json()  # type: ignore[no-any-return]


def _tokens(reply: dict[str, Any]) -> list[tuple[str, float, list[tuple[str, float]]]]:
    content = reply["choices"][0]["logprobs"]["content"]
    return [
        (t["token"], t["logprob"], [(a["token"], a["logprob"]) for a in t["top_logprobs"]])
        for t in content
    ]


def test_greedy_chat_and_logprobs_match_vllms_own_server(stack: Stack, vllm_url: str) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 32,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    ours, theirs = (
        _post(stack.base_url, "/v1/chat/completions", body),
        _post(vllm_url, "/v1/chat/completions", body),
    )
    assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
    assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
    assert ours["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"]
    mine, vllms = _tokens(ours), _tokens(theirs)
    assert [t for t, _, _ in mine] == [t for t, _, _ in vllms]
    for (_, lp, alts), (_, vlp, valts) in zip(mine, vllms, strict=True):
        assert lp == pytest.approx(vlp, abs=1e-3)
        # The same alternatives with the same logprobs; alternatives that tie (vLLM gives
        # them the same rank) may come in either order.
        assert dict(alts) == pytest.approx(dict(valts), abs=1e-3)
    # The prompt is the same token for token, as each server's /tokenize says.
    tokenize = {"model": MODEL, "messages": MESSAGES}
    assert (
        _post(stack.base_url, "/tokenize", tokenize)["tokens"]
        == _post(vllm_url, "/tokenize", tokenize)["tokens"]
    )


def test_greedy_text_completion_matches_vllms_own_server(stack: Stack, vllm_url: str) -> None:
    body = {
        "model": MODEL,
        "prompt": "The starship Wayfarer drifted past the moon, and the captain said",
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": 2,
    }
    ours, theirs = (
        _post(stack.base_url, "/v1/completions", body),
        _post(vllm_url, "/v1/completions", body),
    )
    assert ours["choices"][0]["text"] == theirs["choices"][0]["text"]
    mine, vllms = ours["choices"][0]["logprobs"], theirs["choices"][0]["logprobs"]
    assert mine["tokens"] == vllms["tokens"]
    assert mine["token_logprobs"] == pytest.approx(vllms["token_logprobs"], abs=1e-3)
    assert mine["text_offset"] == vllms["text_offset"]
