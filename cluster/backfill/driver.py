"""``charserve backfill INPUT.jsonl -o OUTPUT.jsonl``: multi-turn character dialogues,
generated at low priority through a charserve gateway.

Each input line is one dialogue::

    {"id": "d1",
     "character_id": "char_...",                 # a stored character, or
     "character": {...card JSON (V1/V2/V3)...},  # an inline card
     "persona": {"name": "Sam", "description": "a curious cadet"},
     "opening": "Captain, a word?",              # the user's first message (optional)
     "scenario": "The ship is adrift.",          # replaces the card's scenario (optional)
     "turns": 4, "seed": 7,
     "max_tokens": 128, "temperature": 0.8}      # optional, else the command's defaults

The driver alternates the character's turns (the card's persona prompt, assembled the way
character frontends do, plus the conversation) with user turns that the model writes while
playing the persona (its own system prompt, with the roles of the conversation swapped).
Without an ``opening`` the dialogue starts from the card's greeting, or, without one, with
a user turn. ``turns`` counts the character's replies. Every request carries a seed derived
from the line's, so a rerun asks for the same samples. When a prompt no longer fits the
context window the oldest exchanges are left out of it (never out of the transcript).

Requests go to ``/v1/chat/completions`` with ``X-Priority: batch``: they never take the
slots kept for interactive chat, and refusals that mean "not now" (429, 503) are retried
after ``Retry-After``. At most ``--concurrency`` dialogues run at once.

Output: one line per finished dialogue, ``{"id", "character", "persona", "messages",
"usage"}`` (``--format openai``) or ``{"id", "conversations": [{"from", "value"}],
"usage"}`` (``--format sharegpt``), appended as each finishes. A rerun skips the ids
already in the output and completes the rest. A line that cannot run (malformed, an unknown
character, over the context window) goes to ``OUTPUT.errors.jsonl`` (``--errors``) with its
line number and reason, and the rest go on. A progress bar with ETA and tokens/s is drawn
on stderr.

The API key comes from ``--api-key`` or ``CHARSERVE_API_KEY``; the gateway from
``--base-url`` or ``CHARSERVE_BASE_URL``.

On a Ray cluster, run the same command as a Ray job (it needs only the gateway's URL; the
output lands on the node running the job's driver, so point ``-o`` at shared storage)::

    ray job submit --address http://HEAD:8265 --working-dir . \\
        --runtime-env-json '{"env_vars": {"CHARSERVE_API_KEY": "csk-..."}}' \\
        -- python -m cluster.backfill dialogues.jsonl -o /shared/dialogues.out.jsonl \\
           --base-url http://GATEWAY:8000 --concurrency 64

Dialogues are planned by :mod:`cluster.backfill.plan`; this module runs them through the
gateway, and :mod:`cluster.backfill.cli` is the command line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import structlog

from cluster.backfill.plan import (
    DEFAULT_SYSTEM_PROMPT,
    DialogueSpec,
    Format,
    LineError,
    Message,
    Plan,
    finished,
    first_history,
    next_cut,
    next_speaker,
    parse_spec,
    plan_dialogue,
    prompt_for,
    request_seed,
)
from cluster.backfill.progress import Progress
from cluster.wire.retry import hinted_retry_s

_RETRY_STATUSES = frozenset({429, 502, 503, 504})

log = structlog.get_logger(__name__)


# -- talking to the gateway --------------------------------------------------------------


@dataclass(slots=True)
class Usage:
    """Tokens spent on one dialogue."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0

    def add(self, usage: Mapping[str, Any]) -> None:
        """Count one response's usage."""
        self.prompt_tokens += int(usage.get("prompt_tokens", 0))
        self.completion_tokens += int(usage.get("completion_tokens", 0))
        self.requests += 1

    def body(self) -> dict[str, int]:
        """The output form."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "requests": self.requests,
        }


@dataclass(slots=True)
class Options:
    """How to generate (from the command line)."""

    base_url: str
    api_key: str | None
    model: str | None
    concurrency: int = 32
    max_tokens: int = 128
    user_max_tokens: int = 64
    temperature: float = 0.8
    priority: str = "batch"
    format: Format = "openai"
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    timeout_s: float = 3600.0
    max_retries: int = 30
    progress: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)


class Gateway:
    """The gateway's chat API, with retries for 'not now' refusals."""

    def __init__(self, client: httpx.AsyncClient, options: Options) -> None:
        self._client = client
        self._options = options
        self._headers = {"X-Priority": options.priority}
        if options.api_key:
            self._headers["Authorization"] = f"Bearer {options.api_key}"
        self._cards: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.model = options.model or ""
        # False once the gateway refused a seed (replicas that cannot honour one, such as
        # vLLM's CPU engine): the rest of the run is unseeded, said once in the log.
        self.seeded = True

    async def resolve_model(self) -> str:
        """The model to ask for: the option, else the gateway's first."""
        if not self.model:
            resp = await self._client.get("/v1/models", headers=self._headers)
            resp.raise_for_status()
            self.model = resp.json()["data"][0]["id"]
        return self.model

    async def card(self, character_id: str) -> dict[str, Any]:
        """A stored character's card (fetched once per run)."""
        future = self._cards.get(character_id)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._cards[character_id] = future
            try:
                future.set_result(await self._fetch_card(character_id))
            except Exception as exc:
                future.set_exception(exc)
                future.exception()  # retrieved here, so never reported as unhandled
            except BaseException:
                future.cancel()
                raise
        return await asyncio.shield(future)

    async def _fetch_card(self, character_id: str) -> dict[str, Any]:
        resp = await self._send("GET", f"/v1/characters/{character_id}", None)
        if resp.status_code == 404:
            raise LineError("unknown_character", f"no character {character_id!r}")
        if resp.status_code != 200:
            raise LineError("character_error", f"HTTP {resp.status_code}: {resp.text[:200]}")
        card = resp.json().get("card")
        if not isinstance(card, dict):
            raise LineError("character_error", "the gateway returned no card")
        return card

    async def chat(
        self, messages: list[Message], max_tokens: int, seed: int, temperature: float
    ) -> tuple[str, dict[str, Any]]:
        """One chat completion: the reply's text and usage; :class:`LineError` if refused."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            **({"seed": seed} if self.seeded else {}),
            **self._options.extra_body,
        }
        resp = await self._send("POST", "/v1/chat/completions", body)
        if resp.status_code == 400 and "seed" in body and _error_param(resp) == "seed":
            if self.seeded:  # concurrent dialogues may meet the refusal at once
                log.warning(
                    "the gateway cannot honour seeds: this run is not reproducible",
                    reason=_error_message(resp),
                )
            self.seeded = False
            return await self.chat(messages, max_tokens, seed, temperature)
        if resp.status_code != 200:
            try:
                error = resp.json()["error"]
                code, message = str(error.get("code")), str(error.get("message"))
            except (ValueError, KeyError, TypeError, AttributeError):
                code, message = f"http_{resp.status_code}", resp.text[:300]
            raise LineError(code, message)
        reply = resp.json()
        return str(reply["choices"][0]["message"]["content"] or ""), reply.get("usage") or {}

    async def _send(self, method: str, path: str, body: Any) -> httpx.Response:
        delay_s = 0.5
        for attempt in range(self._options.max_retries + 1):
            try:
                resp = await self._client.request(method, path, json=body, headers=self._headers)
            except httpx.TransportError as exc:
                if attempt == self._options.max_retries:
                    raise LineError("unreachable", f"the gateway did not answer: {exc}") from exc
            else:
                if resp.status_code not in _RETRY_STATUSES or attempt == self._options.max_retries:
                    return resp
                if _error_code(resp) == "tokens_exceed_limit":
                    return resp  # this request can never fit the tenant's limit
                hinted = hinted_retry_s(resp.headers)
                if hinted is not None:
                    delay_s = hinted
            await asyncio.sleep(min(delay_s, 30.0) * (1 + random.random() * 0.2))
            delay_s = min(delay_s * 2, 30.0)
        raise AssertionError("unreachable")


def _error_param(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["param"])
    except (ValueError, KeyError, TypeError):
        return ""


def _error_message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return ""


def _error_code(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return ""


async def run_dialogue(
    gateway: Gateway, plan: Plan, options: Options
) -> tuple[list[Message], Usage]:
    """Generate one dialogue: the transcript and the tokens it took."""
    spec = plan.spec
    history = first_history(plan)
    usage = Usage()
    start = 0  # prompts leave out history[:start] once it no longer fits
    turn = 0
    while not finished(history, plan):
        speaker = next_speaker(history)
        if speaker == "assistant":
            max_tokens = spec.max_tokens or options.max_tokens
        else:
            max_tokens = options.user_max_tokens
        temperature = spec.temperature if spec.temperature is not None else options.temperature
        while True:
            try:
                text, used = await gateway.chat(
                    prompt_for(plan, history, start),
                    max_tokens,
                    request_seed(spec, turn),
                    temperature,
                )
                break
            except LineError as exc:
                cut = next_cut(history, start) if exc.code == "context_length_exceeded" else None
                if cut is None:
                    raise LineError(exc.code, f"turn {turn + 1}: {exc.message}") from exc
                start = cut
        usage.add(used)
        history.append({"role": speaker, "content": text.strip()})
        turn += 1
    return history, usage


def output_record(plan: Plan, history: list[Message], usage: Usage, fmt: Format) -> dict[str, Any]:
    """One output line."""
    spec = plan.spec
    messages = [*plan.head, *history]
    if fmt == "sharegpt":
        names = {"system": "system", "user": "human", "assistant": "gpt"}
        return {
            "id": spec.id,
            "conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages],
            "usage": usage.body(),
        }
    return {
        "id": spec.id,
        "character": {"id": spec.character_id, "name": plan.character_name},
        "persona": dataclasses.asdict(spec.persona),
        "seed": spec.seed,
        "messages": messages,
        "usage": usage.body(),
    }


# -- the run ------------------------------------------------------------------------------


def finished_ids(path: Path) -> set[str]:
    """Ids already in the output (a torn last line, from a crash, is cut off first)."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with path.open("r+b") as f:
            f.truncate(keep)
        data = data[:keep]
    ids: set[str] = set()
    for raw in data.splitlines():
        try:
            ids.add(str(json.loads(raw)["id"]))
        except (ValueError, KeyError, TypeError):
            continue
    return ids


@dataclass(slots=True)
class Report:
    """What a run did."""

    lines: int = 0
    skipped: int = 0
    completed: int = 0
    failed: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0

    @property
    def completion_tokens_per_s(self) -> float:
        """Generated tokens per second of this run."""
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def read_specs(path: Path) -> tuple[list[DialogueSpec], list[dict[str, Any]]]:
    """The input's dialogues, and an error record for each line that cannot run."""
    specs: list[DialogueSpec] = []
    errors: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                spec = parse_spec(raw, line_no)
            except LineError as exc:
                errors.append(
                    {"id": None, "line": line_no, "code": exc.code, "reason": exc.message}
                )
                continue
            if spec.id in seen:
                errors.append(
                    {
                        "id": spec.id,
                        "line": line_no,
                        "code": "duplicate_id",
                        "reason": f"id {spec.id!r} is already on line {seen[spec.id]}",
                    }
                )
                continue
            seen[spec.id] = line_no
            specs.append(spec)
    return specs, errors


async def backfill(
    input_path: Path,
    output_path: Path,
    options: Options,
    errors_path: Path | None = None,
    client: httpx.AsyncClient | None = None,
    on_plan: Callable[[Plan], None] | None = None,
) -> Report:
    """Generate every dialogue of ``input_path`` not yet in ``output_path``."""
    errors_path = errors_path or output_path.with_name(output_path.stem + ".errors.jsonl")
    started = time.monotonic()
    specs, bad_lines = read_specs(input_path)
    done_ids = finished_ids(output_path)
    todo = [s for s in specs if s.id not in done_ids]
    report = Report(lines=len(specs) + len(bad_lines), skipped=len(specs) - len(todo))
    progress = Progress(len(todo) + len(bad_lines), sys.stderr, options.progress)
    owns_client = client is None
    if client is None:
        limits = httpx.Limits(
            max_connections=options.concurrency + 8, max_keepalive_connections=options.concurrency
        )
        client = httpx.AsyncClient(
            base_url=options.base_url, timeout=httpx.Timeout(options.timeout_s), limits=limits
        )
    output_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with (
            output_path.open("a", encoding="utf-8") as out,
            errors_path.open("w", encoding="utf-8") as err,
        ):

            def fail(record: dict[str, Any]) -> None:
                err.write(json.dumps(record) + "\n")
                err.flush()
                report.failed += 1
                progress.update(failed=1)

            for record in bad_lines:
                fail(record)
            gateway = Gateway(client, options)
            if todo:
                await gateway.resolve_model()
            queue: asyncio.Queue[DialogueSpec] = asyncio.Queue()
            for spec in todo:
                queue.put_nowait(spec)

            async def worker() -> None:
                while not queue.empty():
                    spec = queue.get_nowait()
                    try:
                        card = spec.card or await gateway.card(str(spec.character_id))
                        plan = plan_dialogue(spec, card, options.system_prompt)
                        if on_plan is not None:
                            on_plan(plan)
                        history, usage = await run_dialogue(gateway, plan, options)
                    except LineError as exc:
                        fail(
                            {"id": spec.id, "line": spec.line_no, "code": exc.code,
                             "reason": exc.message}
                        )  # fmt: skip
                        continue
                    out.write(json.dumps(output_record(plan, history, usage, options.format)))
                    out.write("\n")
                    out.flush()
                    report.completed += 1
                    report.requests += usage.requests
                    report.prompt_tokens += usage.prompt_tokens
                    report.completion_tokens += usage.completion_tokens
                    progress.update(tokens=usage.completion_tokens, done=1)

            await asyncio.gather(*(worker() for _ in range(max(1, options.concurrency))))
    finally:
        if owns_client:
            await client.aclose()
    report.elapsed_s = time.monotonic() - started
    progress.draw(final=True)
    return report
