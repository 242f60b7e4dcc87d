"""Prompt assembly: persona layout, macros, lorebook triggering and budget, truncation."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from cluster.characters.cards import Card, parse_card_json
from cluster.characters.persona import (
    Assembled,
    Message,
    PromptTooLong,
    assemble,
    expand_macros,
    render_greeting,
)

DEFAULT = "Write {{char}}'s next reply in a chat with {{user}}."


def words(messages: list[Message]) -> int:
    """The test tokenizer: one token per whitespace-separated word."""
    return sum(len(m["content"].split()) for m in messages)


def card(**data: Any) -> Card:
    fields = {"name": "Mira", "description": "", "personality": "", "scenario": ""}
    return parse_card_json({"spec": "chara_card_v2", "spec_version": "2.0", "data": fields | data})


def run(
    c: Card, history: list[Message] | None = None, max_tokens: int = 10_000, **kw: Any
) -> Assembled:
    return assemble(
        c,
        history if history is not None else [{"role": "user", "content": "hello"}],
        user_name="Ann",
        default_system_prompt=kw.pop("default_system_prompt", DEFAULT),
        count_tokens=kw.pop("count_tokens", words),
        max_prompt_tokens=max_tokens,
        # The lorebook tests read triggered entries in the persona, where this layout puts them.
        layout=kw.pop("layout", "frontend"),
        **kw,
    )


def persona(result: Assembled) -> str:
    assert result.messages[0]["role"] == "system"
    return result.messages[0]["content"]


def lore(*entries: dict[str, Any], **book: Any) -> Card:
    full = [{"content": f"LORE{i}", "keys": [], **e} for i, e in enumerate(entries)]
    return card(character_book={"entries": full, "extensions": {}, **book})


def chat(*contents: str) -> list[Message]:
    """Alternating user/assistant messages, starting with the user."""
    return [
        {"role": "user" if i % 2 == 0 else "assistant", "content": text}
        for i, text in enumerate(contents)
    ]


def test_full_layout() -> None:
    c = card(
        description="{{char}} captains the Wayfarer.",
        personality="calm",
        scenario="{{user}} boards the ship.",
        mes_example="<START>\n{{user}}: Hi\n{{char}}: Hello.\n<START>\n{{user}}: Bye\n"
        "{{char}}: Safe travels.",
        post_history_instructions="Reply as {{char}} only.",
        character_book={
            "entries": [
                {"keys": [], "content": "Before.", "constant": True, "position": "before_char"},
                {"keys": [], "content": "After.", "constant": True, "position": "after_char"},
            ]
        },
    )
    history = chat("hello", "hi there", "how are you?")
    result = run(c, history)
    assert persona(result) == (
        "Write Mira's next reply in a chat with Ann.\n\n"
        "Before.\n\n"
        "Mira captains the Wayfarer.\n\n"
        "Mira's personality: calm\n\n"
        "Scenario: Ann boards the ship.\n\n"
        "After.\n\n"
        "[Example Chat]\nAnn: Hi\nMira: Hello.\n\n"
        "[Example Chat]\nAnn: Bye\nMira: Safe travels."
    )
    assert result.messages[1:-1] == history
    assert result.messages[-1] == {"role": "system", "content": "Reply as Mira only."}
    assert result.dropped == 0
    assert result.prompt_tokens == words(result.messages)


def test_empty_parts_are_skipped_and_no_post_history_message() -> None:
    result = run(card(), default_system_prompt="")
    assert result.messages == [{"role": "user", "content": "hello"}]  # no empty system message
    result = run(card(description="Desc."), default_system_prompt="")
    assert result.messages[0] == {"role": "system", "content": "Desc."}
    assert [m["role"] for m in result.messages] == ["system", "user"]


def test_example_dialogue_without_start_is_one_block() -> None:
    result = run(card(mes_example="{{user}}: Hi\n<bot>: Yo"), default_system_prompt="")
    assert persona(result) == "[Example Chat]\nAnn: Hi\nMira: Yo"


def test_card_system_prompt_overrides_default_and_can_include_it() -> None:
    assert persona(run(card(system_prompt="You are {{char}}."))) == "You are Mira."
    assert persona(run(card(system_prompt="Be {{char}}. {{ORIGINAL}} Stay sharp."))) == (
        "Be Mira. Write Mira's next reply in a chat with Ann. Stay sharp."
    )
    assert persona(run(card(system_prompt="   "))) == "Write Mira's next reply in a chat with Ann."


def test_post_history_instructions_original_is_the_default_or_empty() -> None:
    c = card(post_history_instructions="{{original}} Keep it short, {{char}}.")
    assert run(c).messages[-1]["content"] == "Keep it short, Mira."
    last = run(c, default_post_history_instructions="Never break character.").messages[-1]
    assert last == {"role": "system", "content": "Never break character. Keep it short, Mira."}
    fallback = run(card(), default_post_history_instructions="Default {{user}} note.")
    assert fallback.messages[-1] == {"role": "system", "content": "Default Ann note."}


def test_macros_are_case_insensitive_and_include_legacy_forms() -> None:
    text = "{{char}} {{Char}} {{CHAR}} <BOT> <bot> <Char> | {{user}} {{User}} <USER> <user>"
    assert expand_macros(text, char="Mira", user="Ann") == (
        "Mira Mira Mira Mira Mira Mira | Ann Ann Ann Ann"
    )
    # One pass: a name that looks like a macro is not expanded again.
    assert expand_macros("{{char}}", char="{{user}}", user="Ann") == "{{user}}"
    c = card(description="<BOT> meets <USER>.", first_mes="Hi {{User}}, I'm {{Char}}.")
    assert "Mira meets Ann." in persona(run(c))
    assert render_greeting(c, user_name="Ann") == "Hi Ann, I'm Mira."


def test_history_is_left_verbatim() -> None:
    history = chat("I am {{user}} and you are <BOT>")
    assert run(card(), history).messages[1:] == history


def test_v3_nickname_is_char() -> None:
    c = parse_card_json(
        {
            "spec": "chara_card_v3",
            "spec_version": "3.0",
            "data": {"name": "Mira Vance", "nickname": "Cap", "description": "{{char}} flies."},
        }
    )
    assert "Cap flies." in persona(run(c))


def test_lorebook_keyword_triggers_only_within_scan_depth() -> None:
    c = lore({"keys": ["dragon"]}, scan_depth=2)
    assert "LORE0" in persona(run(c, chat("a dragon!", "what?")))
    result = run(c, chat("a dragon!", "what?", "nothing"))
    assert "LORE0" not in persona(result) and result.lore_entries_used == ()
    assert run(c, chat("DRAGONS", "x")).lore_entries_used == c.character_book.entries  # type: ignore[union-attr]


def test_lorebook_default_scan_depth_is_four() -> None:
    c = lore({"keys": ["dragon"]})
    assert "LORE0" in persona(run(c, chat("dragon", "a", "b", "c")))
    assert "LORE0" not in persona(run(c, chat("dragon", "a", "b", "c", "d")))


def test_lorebook_case_sensitivity_per_entry() -> None:
    c = lore({"keys": ["Dragon"], "case_sensitive": True}, {"keys": ["Dragon"]})
    used = run(c, chat("a dragon")).lore_entries_used
    assert [e.content for e in used] == ["LORE1"]
    used = run(c, chat("a Dragon")).lore_entries_used
    assert [e.content for e in used] == ["LORE0", "LORE1"]


def test_lorebook_selective_needs_a_secondary_key() -> None:
    c = lore({"keys": ["ship"], "selective": True, "secondary_keys": ["engine", "hull"]})
    assert run(c, chat("the ship")).lore_entries_used == ()
    assert len(run(c, chat("the ship's hull")).lore_entries_used) == 1
    # Selective with no secondary keys behaves as a plain entry.
    assert len(run(lore({"keys": ["ship"], "selective": True}), chat("ship")).lore_entries_used)


def test_lorebook_constant_and_disabled() -> None:
    c = lore(
        {"constant": True},
        {"keys": ["dragon"], "enabled": False},
        {"keys": ["dragon"], "constant": True, "enabled": False},
    )
    result = run(c, chat("dragon"))
    assert [e.content for e in result.lore_entries_used] == ["LORE0"]
    assert "LORE1" not in persona(result) and "LORE2" not in persona(result)


def test_lorebook_insertion_order_lower_first() -> None:
    c = lore(
        {"constant": True, "insertion_order": 30},
        {"constant": True, "insertion_order": 10},
        {"constant": True, "insertion_order": 20},
    )
    text = persona(run(c, default_system_prompt=""))
    assert text == "LORE1\n\nLORE2\n\nLORE0"


def test_lorebook_token_budget_drops_lowest_priority_first() -> None:
    c = lore(
        {"content": "one two three", "constant": True, "priority": 1, "insertion_order": 1},
        {"content": "four five", "constant": True, "priority": 9, "insertion_order": 2},
        {"content": "six seven", "constant": True, "priority": 5, "insertion_order": 3},
        token_budget=5,
    )
    assert [e.content for e in run(c).lore_entries_used] == ["four five", "six seven"]
    # Without priorities, the lower insertion_order is dropped first.
    c = lore(
        {"content": "a b", "constant": True, "insertion_order": 3},
        {"content": "c d", "constant": True, "insertion_order": 1},
        {"content": "e f", "constant": True, "insertion_order": 2},
        token_budget=4,
    )
    assert [e.content for e in run(c).lore_entries_used] == ["e f", "a b"]


def test_lorebook_recursive_scanning() -> None:
    entries = ({"keys": ["ship"], "content": "The ship has a reactor."}, {"keys": ["reactor"]})
    assert len(run(lore(*entries, recursive_scanning=True), chat("ship")).lore_entries_used) == 2
    assert len(run(lore(*entries), chat("ship")).lore_entries_used) == 1


def test_lorebook_regex_keys_and_decorators() -> None:
    c = lore(
        {"keys": [r"\bdrag(on|ons)\b"], "use_regex": True, "content": "@@depth 4\nDragons fly."},
        {"keys": ["(unclosed"], "use_regex": True},
    )
    result = run(c, chat("two Dragons and a (unclosed bracket"), default_system_prompt="")
    assert persona(result) == "Dragons fly."


def test_truncation_drops_the_oldest_turns_first() -> None:
    c = card(description="Persona words here.", post_history_instructions="Stay in character.")
    greeting = {"role": "assistant", "content": "greeting"}
    history = [greeting, *chat("u1 x", "a1 x", "u2 x", "a2 x", "u3 x", "a3 x", "latest question")]
    full = run(c, history)
    assert full.dropped == 0
    # Room for everything except the greeting and the first pair.
    limit = full.prompt_tokens - 5
    result = run(c, history, max_tokens=limit)
    assert result.dropped == 3
    assert result.messages[0] == full.messages[0]
    assert result.messages[1:-1] == history[3:]
    assert result.messages[-1] == {"role": "system", "content": "Stay in character."}
    assert result.prompt_tokens == words(result.messages) <= limit


def test_truncation_keeps_a_user_turn_with_its_reply() -> None:
    history = chat("u1", "a1 long long long", "u2", "a2", "u3")
    base = words(run(card(), history).messages)
    # Dropping u1 alone would fit, but the cut only falls in front of a user message.
    result = run(card(), history, max_tokens=base - 1)
    assert result.dropped == 2
    assert result.messages[1]["content"] == "u2"


def test_truncation_never_drops_the_latest_user_message() -> None:
    history = [
        *chat("old", "older reply", "latest one"),
        {"role": "assistant", "content": "partial"},
    ]
    c = card(description="persona")
    minimum = words([*run(c).messages[:1], *history[2:]])
    result = run(c, history, max_tokens=minimum)
    assert result.dropped == 2
    assert [m["content"] for m in result.messages[1:]] == ["latest one", "partial"]


def test_prompt_too_long() -> None:
    c = card(description="a very long persona indeed")
    with pytest.raises(PromptTooLong) as err:
        run(c, chat("hi", "hello", "tell me everything"), max_tokens=8)
    assert err.value.max_prompt_tokens == 8
    assert err.value.prompt_tokens > 8
    assert isinstance(err.value, ValueError)


def test_long_histories_are_counted_a_logarithmic_number_of_times() -> None:
    calls = 0

    def counting(messages: list[Message]) -> int:
        nonlocal calls
        calls += 1
        return words(messages)

    history = chat(*(f"turn {i}" for i in range(2001)))
    result = run(card(description="persona"), history, max_tokens=101, count_tokens=counting)
    assert result.messages[-1] == history[-1]
    assert result.prompt_tokens <= 101
    # The largest cut that fits: one more pair would not.
    assert words(result.messages) + 4 > 101
    assert calls <= 16


def test_stable_layout_keeps_the_head_identical_as_triggered_entries_change() -> None:
    c = card(
        description="{{char}} captains the Wayfarer.",
        post_history_instructions="Stay in character.",
        character_book={
            "entries": [
                {"keys": [], "content": "Always.", "constant": True},
                {"keys": ["dragon"], "content": "Dragons fly."},
                {"keys": ["storm"], "content": "Storms rage."},
            ],
            "extensions": {},
            "scan_depth": 1,
        },
    )
    turns = chat("a dragon!", "yes", "a storm!", "no", "calm now")
    prompts = [run(c, turns[: n + 1], layout="stable").messages for n in (0, 2, 4)]
    # The persona (with the constant entry) never changes; each later prompt begins with
    # all of the previous one's history, so the engine's cache holds it.
    assert prompts[0][0] == prompts[1][0] == prompts[2][0]
    assert "Always." in prompts[0][0]["content"]
    assert all("Dragons" not in p[0]["content"] for p in prompts)
    for earlier, later in itertools.pairwise(prompts):
        assert later[: len(earlier) - 1] == earlier[:-1]
    ends = [p[-1]["content"] for p in prompts]
    assert ends == [
        "Dragons fly.\n\nStay in character.",
        "Storms rage.\n\nStay in character.",
        "Stay in character.",
    ]
    frontend = run(c, turns[:3], layout="frontend").messages
    assert "Storms rage." in frontend[0]["content"]
