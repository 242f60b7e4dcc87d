"""Planning a backfill dialogue, pure: input lines checked into specs, cards resolved into
the prompt parts of a :class:`Plan`, and the dialogue's next prompt, speaker and seed.

The HTTP driver (:mod:`cluster.backfill.driver`) and vLLM's offline baseline
(:mod:`workers.baselines.offline_chat`) play the same plans turn by turn, so both generate
the same dialogues. Cards are parsed and assembled with :mod:`cluster.characters`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from cluster.characters.cards import CardError, parse_card_json
from cluster.characters.persona import assemble, render_greeting
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
