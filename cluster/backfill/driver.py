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
        -- python -m cluster.backfill.driver dialogues.jsonl -o /shared/dialogues.out.jsonl \\
           --base-url http://GATEWAY:8000 --concurrency 64

Character cards are parsed and assembled with :mod:`cluster.characters.cards` and
:mod:`cluster.characters.persona`, imported when a dialogue is planned (this module is otherwise only
an HTTP client).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import random
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import httpx

from cluster.errors import InvalidInput

Message = dict[str, str]
Format = Literal["openai", "sharegpt"]

DEFAULT_SYSTEM_PROMPT = (
    "Write {{char}}'s next reply in a fictional chat between {{char}} and {{user}}. "
    "Stay in character."
)
USER_SYSTEM_PROMPT = (
    "You are {user}. {description}\n\n"
    "You are chatting with {char}.{scenario} Write {user}'s next message to {char}: one "
    "short message in {user}'s own voice, with no name prefix. Never write {char}'s lines."
)
KICKOFF = "[Start the conversation with {char}.]"
_RETRY_STATUSES = frozenset({429, 502, 503, 504})


class LineError(InvalidInput):
    """A dialogue that cannot be generated: ``code`` and a readable reason."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Persona:
    """The user the model plays in user turns."""

    name: str
    description: str = ""


@dataclass(frozen=True, slots=True)
class DialogueSpec:
    """One input line, checked."""

    id: str
    line_no: int
    persona: Persona
    turns: int
    seed: int
    character_id: str | None = None
    card: dict[str, Any] | None = None
    opening: str | None = None
    scenario: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None


def _opt_str(obj: Mapping[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise LineError("invalid_line", f"{key} must be a string")
    return value


def parse_spec(raw: str, line_no: int) -> DialogueSpec:
    """Check one input line (raises :class:`LineError` with the reason)."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise LineError("invalid_json", f"not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise LineError("invalid_json", "a line must be a JSON object")
    dialogue_id = obj.get("id", obj.get("custom_id"))
    if not isinstance(dialogue_id, str | int) or isinstance(dialogue_id, bool) or dialogue_id == "":
        raise LineError("invalid_line", "id must be a non-empty string")
    character_id, card = obj.get("character_id"), obj.get("character")
    if (character_id is None) == (card is None):
        raise LineError("invalid_line", "give exactly one of character_id and character")
    if character_id is not None and (not isinstance(character_id, str) or not character_id):
        raise LineError("invalid_line", "character_id must be a non-empty string")
    if card is not None and not isinstance(card, dict):
        raise LineError("invalid_line", "character must be a card (a JSON object)")
    persona = obj.get("persona") or {}
    if not isinstance(persona, dict) or not isinstance(persona.get("name", "User"), str):
        raise LineError("invalid_line", "persona must be {name, description}")
    turns, seed = obj.get("turns", 3), obj.get("seed", 0)
    for name, value, low in (("turns", turns, 1), ("seed", seed, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise LineError("invalid_line", f"{name} must be an integer >= {low}")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise LineError("invalid_line", "max_tokens must be a positive integer")
    temperature = obj.get("temperature")
    if temperature is not None and not isinstance(temperature, int | float):
        raise LineError("invalid_line", "temperature must be a number")
    return DialogueSpec(
        id=str(dialogue_id),
        line_no=line_no,
        persona=Persona(str(persona.get("name") or "User"), str(persona.get("description") or "")),
        turns=turns,
        seed=seed,
        character_id=character_id,
        card=card,
        opening=_opt_str(obj, "opening"),
        scenario=_opt_str(obj, "scenario"),
        max_tokens=max_tokens,
        temperature=float(temperature) if temperature is not None else None,
    )


@dataclass(frozen=True, slots=True)
class Plan:
    """A dialogue ready to run: the character's prompt parts, resolved once."""

    spec: DialogueSpec
    character_name: str
    head: list[Message]
    """The character's persona (system) messages, before the conversation."""
    tail: list[Message]
    """Post-history instructions, after the conversation."""
    greeting: str
    user_system: str

    def to_json(self) -> dict[str, Any]:
        """A JSON form (for the offline reference run)."""
        return {
            "spec": {**dataclasses.asdict(self.spec), "card": None},
            "character_name": self.character_name,
            "head": self.head,
            "tail": self.tail,
            "greeting": self.greeting,
            "user_system": self.user_system,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Plan:
        """Inverse of :meth:`to_json`."""
        spec = dict(obj["spec"])
        spec["persona"] = Persona(**spec["persona"])
        return cls(
            DialogueSpec(**spec),
            obj["character_name"],
            list(obj["head"]),
            list(obj["tail"]),
            obj["greeting"],
            obj["user_system"],
        )


def _estimate_tokens(messages: list[Message]) -> int:
    """A rough count (the gateway does the exact one): lorebook budgets only."""
    return sum(len(m.get("content", "")) // 3 + 4 for m in messages)


def plan_dialogue(
    spec: DialogueSpec, card_json: Mapping[str, Any], system_prompt: str = DEFAULT_SYSTEM_PROMPT
) -> Plan:
    """Resolve a card into the dialogue's prompt parts (:class:`LineError` for a bad card)."""
    from cluster.characters.cards import CardError, parse_card_json
    from cluster.characters.persona import assemble, render_greeting

    try:
        card = parse_card_json(card_json)
    except CardError as exc:
        raise LineError("invalid_character", f"the character card is invalid: {exc}") from exc
    if spec.scenario is not None:
        card = dataclasses.replace(card, scenario=spec.scenario)
    user = spec.persona.name
    # The opening (if any) stands in for the conversation, so lorebook entries it names
    # are in the persona; the marker splits the persona from the post-history part.
    marker = {"role": "user", "content": spec.opening or spec.scenario or ""}
    assembled = assemble(
        card,
        [marker],
        user_name=user,
        default_system_prompt=system_prompt,
        count_tokens=_estimate_tokens,
        max_prompt_tokens=10**9,
    )
    # Persona and post-history parts are system messages; the marker is the one user turn.
    at = next(i for i, m in enumerate(assembled.messages) if m["role"] == "user")
    head, tail = assembled.messages[:at], assembled.messages[at + 1 :]
    greeting = "" if spec.opening else render_greeting(card, user_name=user).strip()
    scenario = f" Scenario: {card.scenario.strip()}" if card.scenario.strip() else ""
    user_system = USER_SYSTEM_PROMPT.format(
        user=user,
        description=spec.persona.description.strip(),
        char=card.display_name,
        scenario=scenario,
    )
    return Plan(spec, card.display_name, head, tail, greeting, user_system)


# -- the dialogue, step by step (shared with the offline reference run) -------------------


def first_history(plan: Plan) -> list[Message]:
    """The conversation before anything is generated."""
    if plan.spec.opening:
        return [{"role": "user", "content": plan.spec.opening}]
    if plan.greeting:
        return [{"role": "assistant", "content": plan.greeting}]
    return []


def next_speaker(history: list[Message]) -> Literal["user", "assistant"]:
    """Who speaks next: the user after the character (or at the start), else the character."""
    return "user" if not history or history[-1]["role"] == "assistant" else "assistant"


def character_turns(history: list[Message], plan: Plan) -> int:
    """The character's replies generated so far (a greeting is not one)."""
    replies = sum(1 for m in history if m["role"] == "assistant")
    return replies - (1 if plan.greeting and not plan.spec.opening else 0)


def finished(history: list[Message], plan: Plan) -> bool:
    """True once the character has replied ``turns`` times."""
    return character_turns(history, plan) >= plan.spec.turns


def prompt_for(plan: Plan, history: list[Message], start: int = 0) -> list[Message]:
    """The prompt for the next turn, with ``history[start:]`` as the conversation."""
    window = history[start:]
    if next_speaker(history) == "assistant":
        return [*plan.head, *window, *plan.tail]
    # The model plays the user: the roles of the conversation swap.
    swapped = [
        {"role": "user" if m["role"] == "assistant" else "assistant", "content": m["content"]}
        for m in window
    ]
    if not swapped or swapped[0]["role"] == "assistant":
        swapped.insert(0, {"role": "user", "content": KICKOFF.format(char=plan.character_name)})
    return [{"role": "system", "content": plan.user_system}, *swapped]


def next_cut(history: list[Message], start: int) -> int | None:
    """Where the prompt's conversation starts once the oldest exchange is left out: the
    next message the character answered, keeping the last message; None if nothing more
    can go."""
    for i in range(start + 1, len(history) - 1):
        if history[i]["role"] == history[-1]["role"]:
            return i
    return None


def request_seed(spec: DialogueSpec, turn: int) -> int:
    """The seed of a dialogue's ``turn``-th request (stable across reruns)."""
    return (spec.seed * 1_000_003 + turn * 7919 + 1) % (2**31 - 1)


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
            "seed": seed,
            **self._options.extra_body,
        }
        resp = await self._send("POST", "/v1/chat/completions", body)
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
                hinted = resp.headers.get("retry-after", "")
                if hinted.isdigit():
                    delay_s = float(hinted)
            await asyncio.sleep(min(delay_s, 30.0) * (1 + random.random() * 0.2))
            delay_s = min(delay_s * 2, 30.0)
        raise AssertionError("unreachable")


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


class Progress:
    """A one-line progress bar on stderr: dialogues done, tokens/s, ETA."""

    def __init__(self, total: int, stream: TextIO, enabled: bool) -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self.tokens = 0
        self._stream = stream
        self._enabled = enabled
        self._tty = stream.isatty()
        self._start = time.monotonic()
        self._last = 0.0

    def update(self, tokens: int = 0, done: int = 0, failed: int = 0) -> None:
        """Count progress; redraw now and then."""
        self.tokens += tokens
        self.done += done
        self.failed += failed
        now = time.monotonic()
        if now - self._last >= (0.25 if self._tty else 10.0):
            self._last = now
            self.draw()

    def line(self) -> str:
        """The progress line."""
        elapsed = max(time.monotonic() - self._start, 1e-9)
        finished = self.done + self.failed
        rate = self.tokens / elapsed
        eta = (self.total - finished) * elapsed / finished if finished else float("nan")
        width = 24
        filled = int(width * finished / self.total) if self.total else width
        eta_text = "--:--" if eta != eta else time.strftime("%H:%M:%S", time.gmtime(eta))
        return (
            f"[{'#' * filled}{'.' * (width - filled)}] {finished}/{self.total} dialogues"
            f" ({self.failed} failed) | {rate:,.1f} tok/s | ETA {eta_text}"
        )

    def draw(self, final: bool = False) -> None:
        """Write the line (over the last one on a terminal)."""
        if not self._enabled:
            return
        end = "\n" if final or not self._tty else ""
        self._stream.write(("\r" if self._tty else "") + self.line() + end)
        self._stream.flush()


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``charserve backfill``."""
    parser.add_argument("input", help="dialogues to generate (JSONL, one per line)")
    parser.add_argument("-o", "--output", required=True, help="output JSONL (appended to)")
    parser.add_argument("--errors", default=None, help="errors JSONL (OUTPUT.errors.jsonl)")
    parser.add_argument(
        "--base-url", default=os.environ.get("CHARSERVE_BASE_URL", "http://127.0.0.1:8000")
    )
    parser.add_argument("--api-key", default=os.environ.get("CHARSERVE_API_KEY"))
    parser.add_argument("--model", default=None, help="default: the gateway's first model")
    parser.add_argument("--concurrency", type=int, default=32, help="dialogues in flight")
    parser.add_argument("--max-tokens", type=int, default=128, help="per character turn")
    parser.add_argument("--user-max-tokens", type=int, default=64, help="per user turn")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--priority", default="batch", choices=("batch", "standard", "interactive"))
    parser.add_argument("--format", default="openai", choices=("openai", "sharegpt"))
    parser.add_argument("--system-prompt", default=DEFAULT_SYSTEM_PROMPT)
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per request")
    parser.add_argument("--max-retries", type=int, default=30, help="per request, on 429/503")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def options_from(args: argparse.Namespace) -> Options:
    """The run's options from parsed arguments."""
    return Options(
        base_url=args.base_url.rstrip("/"),
        api_key=args.api_key,
        model=args.model,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        user_max_tokens=args.user_max_tokens,
        temperature=args.temperature,
        priority=args.priority,
        format=args.format,
        system_prompt=args.system_prompt,
        timeout_s=args.timeout_s,
        max_retries=args.max_retries,
        progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    """Run ``charserve backfill``; 0 when every dialogue is done, 1 if some failed."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        report = asyncio.run(
            backfill(
                Path(args.input),
                Path(args.output),
                options_from(args),
                Path(args.errors) if args.errors else None,
            )
        )
    except (OSError, httpx.HTTPError) as exc:
        sys.stderr.write(f"charserve backfill: {exc}\n")
        return 2
    sys.stderr.write(
        f"{report.completed} dialogues written, {report.skipped} already done, "
        f"{report.failed} failed; {report.requests} requests, "
        f"{report.completion_tokens} tokens in {report.elapsed_s:.1f} s "
        f"({report.completion_tokens_per_s:.1f} tok/s)\n"
    )
    return 1 if report.failed else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m cluster.backfill.driver`` (what ``charserve backfill`` runs)."""
    parser = argparse.ArgumentParser(prog="backfill", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
