"""Character card import: V1/V2/V3 JSON, PNG chunks, lossless round trips, clear errors."""

from __future__ import annotations

import base64
import copy
import json
import random
import struct
import zlib
from typing import Any

import pytest

from cluster.characters.cards import (
    MAX_CARD_BYTES,
    MAX_PNG_BYTES,
    PNG_SIGNATURE,
    CardError,
    card_to_png,
    parse_card,
    parse_card_json,
    parse_card_png,
)

V1: dict[str, Any] = {
    "name": "Mira",
    "description": "Captain of the Wayfarer.",
    "personality": "calm, dry humour",
    "scenario": "On the bridge.",
    "first_mes": "Welcome aboard, {{user}}.",
    "mes_example": "<START>\n{{user}}: Hi\n{{char}}: Hello.",
    "avatar": "none",  # an unknown V1 field
}


def v2_card(**data: Any) -> dict[str, Any]:
    return {
        "spec": "chara_card_v2",
        "spec_version": "2.0",
        "data": {
            "name": "Mira",
            "description": "Captain.",
            "personality": "calm",
            "scenario": "Bridge.",
            "first_mes": "Hello.",
            "mes_example": "",
            "creator_notes": "Be nice to her.",
            "system_prompt": "You are {{char}}. {{original}}",
            "post_history_instructions": "Stay in character.",
            "alternate_greetings": ["Hi again.", "Oh, it's you."],
            "tags": ["sci-fi"],
            "creator": "someone",
            "character_version": "1.2",
            "extensions": {"depth_prompt": {"prompt": "x", "depth": 4}, "talkativeness": "0.5"},
            **data,
        },
    }


def v3_card(**data: Any) -> dict[str, Any]:
    card = v2_card(**data)
    card.update(spec="chara_card_v3", spec_version="3.0")
    card["data"].update(
        nickname=card["data"].get("nickname", "Cap"),
        group_only_greetings=["Hello, crew."],
        creator_notes_multilingual={"en": "notes"},
        source=["https://example.invalid/mira"],
        creation_date=1700000000,
        modification_date=1700000001,
        assets=[{"type": "icon", "uri": "ccdefault:", "name": "main", "ext": "png"}],
    )
    return card


BOOK: dict[str, Any] = {
    "name": "Wayfarer lore",
    "scan_depth": 3,
    "token_budget": 100,
    "recursive_scanning": True,
    "extensions": {"tool/x": 1},
    "entries": [
        {
            "keys": ["engine", "reactor"],
            "content": "The reactor hums.",
            "extensions": {"tool/depth": 2},
            "enabled": True,
            "insertion_order": 10,
            "case_sensitive": True,
            "priority": 5,
            "id": 7,
            "comment": "engines",
            "selective": True,
            "secondary_keys": ["noise"],
            "constant": False,
            "position": "after_char",
            "unknown_entry_field": [1, 2],
        },
        {"keys": ["wayfarer"], "content": "The ship is old."},
    ],
}


def test_v1_json_imports_and_round_trips() -> None:
    card = parse_card_json(json.dumps(V1).encode())
    assert card.spec == "chara_card_v1"
    assert (card.name, card.description, card.personality) == (
        "Mira",
        "Captain of the Wayfarer.",
        "calm, dry humour",
    )
    assert card.first_mes == "Welcome aboard, {{user}}."  # macros are expanded at prompt time
    assert card.system_prompt == "" and card.alternate_greetings == ()
    assert card.character_book is None
    assert card.to_json() == V1


def test_v2_json_imports_every_prompt_field() -> None:
    card = parse_card_json(v2_card(character_book=BOOK))
    assert card.spec == "chara_card_v2"
    assert card.system_prompt == "You are {{char}}. {{original}}"
    assert card.post_history_instructions == "Stay in character."
    assert card.alternate_greetings == ("Hi again.", "Oh, it's you.")
    assert card.nickname is None and card.display_name == "Mira"
    book = card.character_book
    assert book is not None
    assert (book.scan_depth, book.token_budget, book.recursive_scanning) == (3, 100, True)
    assert book.extensions == {"tool/x": 1}
    first, second = book.entries
    assert first.keys == ("engine", "reactor") and first.secondary_keys == ("noise",)
    assert (first.case_sensitive, first.selective, first.constant) == (True, True, False)
    assert (first.position, first.priority, first.id, first.insertion_order) == (
        "after_char",
        5,
        7,
        10,
    )
    assert first.extensions == {"tool/depth": 2}
    # Spec defaults for everything the second entry leaves out.
    assert second.enabled is True and second.insertion_order == 0
    assert second.position == "before_char" and second.priority is None
    assert not (second.case_sensitive or second.selective or second.constant or second.use_regex)


def test_v3_json_imports_with_nickname() -> None:
    card = parse_card_json(json.dumps(v3_card()))
    assert card.spec == "chara_card_v3"
    assert card.name == "Mira" and card.nickname == "Cap" and card.display_name == "Cap"
    assert card.first_mes == "Hello."


@pytest.mark.parametrize("make", [lambda: V1, lambda: v2_card(character_book=BOOK), v3_card])
def test_unknown_fields_and_extensions_survive_a_round_trip(make: Any) -> None:
    doc = copy.deepcopy(make())
    doc["x_top_level"] = {"nested": [1, {"a": None}]}
    if "data" in doc:
        doc["data"]["x_data_field"] = "kept"
        doc["data"]["extensions"]["chub/full_path"] = {"id": 42, "deep": [True, 1.5]}
    as_text = json.dumps(doc)
    card = parse_card_json(as_text)
    assert card.to_json() == json.loads(as_text)
    # Through a PNG too, and the export is a copy the caller cannot corrupt the card with.
    assert parse_card_png(card_to_png(card.to_json())).to_json() == json.loads(as_text)
    card.to_json()["name"] = "changed"
    assert card.to_json() == json.loads(as_text)


def test_metadata_is_kept_but_never_type_checked() -> None:
    # Cards in the wild carry odd metadata; it never reaches a prompt, so it must not block.
    card = parse_card_json(v2_card(tags="sci-fi, space", creator=None, character_version=3))
    assert card.to_json()["data"]["tags"] == "sci-fi, space"


def test_png_with_chara_only() -> None:
    card = parse_card(card_to_png(v2_card()), "image/png")
    assert card.spec == "chara_card_v2" and card.name == "Mira"


def test_png_with_ccv3_only() -> None:
    png = card_to_png(v3_card())
    assert b"tEXtccv3\0" in png and b"tEXtchara\0" not in png
    card = parse_card(png, None)
    assert card.spec == "chara_card_v3" and card.nickname == "Cap"


@pytest.mark.parametrize("v3_first", [True, False])
def test_png_with_both_chunks_uses_ccv3(v3_first: bool) -> None:
    v3 = v3_card(name="Mira Three")
    v2 = v2_card(name="Mira Two")
    chunks = [("ccv3", v3), ("chara", v2)] if v3_first else [("chara", v2), ("ccv3", v3)]
    card = parse_card_png(png_with_text(chunks))
    assert card.spec == "chara_card_v3" and card.name == "Mira Three"
    # card_to_png's V2 fallback makes the same kind of file.
    assert parse_card_png(card_to_png(v3, chara=v2)).name == "Mira Three"


def test_parse_card_sniffs_by_signature_not_by_content_type() -> None:
    assert parse_card(card_to_png(v2_card()), "application/octet-stream").spec == "chara_card_v2"
    assert parse_card(json.dumps(V1).encode(), "application/json").spec == "chara_card_v1"
    assert parse_card(json.dumps(V1).encode(), None).name == "Mira"


def test_greetings() -> None:
    card = parse_card_json(v2_card())
    assert card.greeting() == "Hello."
    assert [card.greeting(i) for i in range(3)] == ["Hello.", "Hi again.", "Oh, it's you."]
    picks = {card.greeting(rng=random.Random(seed)) for seed in range(50)}
    assert picks == set(card.greetings)
    with pytest.raises(CardError) as err:
        card.greeting(3)
    assert err.value.param == "greeting"


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"{not json", None),
        (b"\xff\xfe\x00garbage", None),
        (b"[1, 2]", None),
        (b'"a string"', None),
        ({"spec": "chara_card_v9", "data": {"name": "X"}}, "spec"),
        ({"spec": "chara_card_v2", "data": "nope"}, "data"),
        ({"spec": "chara_card_v2"}, "data"),
        ({"description": "no name"}, "name"),
        ({"name": "   "}, "name"),
        ({"name": 5}, "name"),
        ({"name": "X", "description": 42}, "description"),
        (v2_card(description=42), "data.description"),
        (v2_card(system_prompt=["x"]), "data.system_prompt"),
        (v2_card(alternate_greetings="Hi again."), "data.alternate_greetings"),
        (v2_card(alternate_greetings=["ok", 3]), "data.alternate_greetings"),
        (v2_card(extensions=[]), "data.extensions"),
        (v3_card(nickname=7), "data.nickname"),
        (v2_card(character_book=[]), "data.character_book"),
        (v2_card(character_book={"entries": {}}), "data.character_book.entries"),
        (v2_card(character_book={"scan_depth": "4"}), "data.character_book.scan_depth"),
        (
            v2_card(character_book={"entries": [{"keys": [1], "content": "c"}]}),
            "data.character_book.entries[0].keys",
        ),
        (
            v2_card(character_book={"entries": [{"keys": ["k"], "content": "c"}, "x"]}),
            "data.character_book.entries[1]",
        ),
        (
            v2_card(character_book={"entries": [{"keys": ["k"], "enabled": "yes"}]}),
            "data.character_book.entries[0].enabled",
        ),
        (
            v2_card(character_book={"entries": [{"keys": ["k"], "insertion_order": True}]}),
            "data.character_book.entries[0].insertion_order",
        ),
        (
            v2_card(character_book={"entries": [{"keys": ["k"], "position": "top"}]}),
            "data.character_book.entries[0].position",
        ),
    ],
)
def test_invalid_cards_name_the_field(raw: Any, param: str | None) -> None:
    with pytest.raises(CardError) as err:
        parse_card_json(raw)
    assert err.value.code == "invalid_card"
    assert err.value.param == param
    assert isinstance(err.value, ValueError) and err.value.message == str(err.value)


def test_oversized_json_is_refused_before_parsing() -> None:
    doc = {"name": "X", "description": "a" * MAX_CARD_BYTES}
    with pytest.raises(CardError) as err:
        parse_card_json(json.dumps(doc))
    assert err.value.code == "card_too_large"
    with pytest.raises(CardError) as err:
        parse_card(b" " * (MAX_CARD_BYTES + 1), "application/json")
    assert err.value.code == "card_too_large"


def test_oversized_png_is_refused() -> None:
    png = card_to_png(V1)
    huge = png[:-12] + b"\0" * (MAX_PNG_BYTES) + png[-12:]
    with pytest.raises(CardError) as err:
        parse_card(huge, "image/png")
    assert err.value.code == "card_too_large"


def test_broken_pngs() -> None:
    good = card_to_png(v2_card())
    text_at = good.index(b"tEXtchara")
    cases = {
        "bad signature": b"\x89PNX" + good[4:],
        "truncated": good[: text_at + 40],
        "no IEND": good[:-12],
        "bad CRC": good[: text_at + 20] + bytes([good[text_at + 20] ^ 1]) + good[text_at + 21 :],
    }
    for what, data in cases.items():
        with pytest.raises(CardError) as err:
            parse_card_png(data)
        assert err.value.code == "invalid_png", what
    with pytest.raises(CardError) as err:  # says PNG, is not one
        parse_card(json.dumps(V1).encode(), "image/png")
    assert err.value.code == "invalid_png"


def test_png_without_a_card_or_with_garbage_in_it() -> None:
    with pytest.raises(CardError) as err:
        parse_card_png(png_with_text([]))
    assert err.value.code == "invalid_card"
    with pytest.raises(CardError) as err:
        parse_card_png(png_with_text([("chara", None)], raw=b"bm90IGpzb24="))  # "not json"
    assert err.value.code == "invalid_card"


def png_with_text(chunks: list[tuple[str, Any]], raw: bytes | None = None) -> bytes:
    """A PNG with tEXt chunks in the given order (``raw`` overrides every payload)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    parts = [PNG_SIGNATURE, chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))]
    for keyword, doc in chunks:
        payload = raw if raw is not None else base64.b64encode(json.dumps(doc).encode())
        parts.append(chunk(b"tEXt", keyword.encode() + b"\0" + payload))
    parts += [chunk(b"IDAT", zlib.compress(b"\0\0")), chunk(b"IEND", b"")]
    return b"".join(parts)
