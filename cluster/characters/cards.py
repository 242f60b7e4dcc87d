"""Character cards: import Character Card V1, V2 and V3 from JSON or PNG.

A card is the unit a tenant uploads to define a character. Three shapes exist in the
wild: V1 (TavernAI's flat object), V2 (``{"spec": "chara_card_v2", "data": {...}}``,
github.com/malfoyslastname/character-card-spec-v2) and V3 (``"chara_card_v3"``, a superset
of V2, github.com/kwaroran/character-card-spec-v3). PNG cards carry the JSON base64-encoded
in ``tEXt`` chunks: ``chara`` (V1/V2) and ``ccv3`` (V3; it wins when both are present).

Import yields a :class:`Card`: a typed, normalised view of the fields that build prompts,
plus ``document``, the JSON exactly as imported (V1 stays V1, unknown fields and every
``extensions`` object untouched), so :meth:`Card.to_json` exports a lossless round trip.
Only the prompt fields, ``extensions`` and ``character_book`` are type-checked; metadata
(``creator_notes``, ``tags``, ``creator``, ``character_version``, V3's dates, ``source``,
``assets``...) is kept in ``document`` but never reaches a prompt, whatever its shape.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import random
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from cluster.errors import InvalidInput

MAX_CARD_BYTES = 2 * 1024 * 1024
"""Largest card JSON accepted (bytes, also for the JSON decoded from a PNG chunk)."""
MAX_PNG_BYTES = 8 * 1024 * 1024
"""Largest PNG card accepted (bytes)."""

MAX_LORE_ENTRIES = 512
"""Most lorebook entries in one card (each is scanned at every turn)."""
MAX_LORE_KEYS = 64
"""Most keys (and secondary keys) of one lorebook entry."""
MAX_LORE_KEY_CHARS = 512
"""Longest lorebook key (a regex key is compiled and run at every turn)."""

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SPEC_V1: Final = "chara_card_v1"
SPEC_V2: Final = "chara_card_v2"
SPEC_V3: Final = "chara_card_v3"
Spec = Literal["chara_card_v1", "chara_card_v2", "chara_card_v3"]
Position = Literal["before_char", "after_char"]

_PROMPT_FIELDS = (
    "description", "personality", "scenario", "first_mes", "mes_example",
    "system_prompt", "post_history_instructions",
)  # fmt: skip


class CardError(InvalidInput):
    """A card that cannot be imported; ``code`` and ``param`` feed the OpenAI error body."""

    def __init__(self, message: str, *, code: str = "invalid_card", param: str | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


@dataclass(frozen=True, slots=True)
class LoreEntry:
    """One ``character_book`` entry, with the spec's defaults filled in."""

    keys: tuple[str, ...]
    content: str
    enabled: bool = True
    insertion_order: float = 0
    case_sensitive: bool = False
    selective: bool = False
    secondary_keys: tuple[str, ...] = ()
    constant: bool = False
    use_regex: bool = False
    position: Position = "before_char"
    priority: float | None = None
    id: int | str | None = None
    name: str | None = None
    comment: str | None = None
    extensions: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Lorebook:
    """A card's embedded lorebook (``character_book``)."""

    entries: tuple[LoreEntry, ...]
    scan_depth: int | None = None
    token_budget: int | None = None
    recursive_scanning: bool = False
    name: str | None = None
    description: str | None = None
    extensions: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Card:
    """An imported character card: the prompt fields, and the document as imported."""

    spec: Spec
    name: str
    description: str = ""
    personality: str = ""
    scenario: str = ""
    first_mes: str = ""
    mes_example: str = ""
    system_prompt: str = ""
    post_history_instructions: str = ""
    alternate_greetings: tuple[str, ...] = ()
    character_book: Lorebook | None = None
    nickname: str | None = None
    document: dict[str, Any] = field(default_factory=dict)

    @property
    def display_name(self) -> str:
        """What ``{{char}}`` expands to: V3's ``nickname`` when set, else ``name``."""
        return self.nickname or self.name

    @property
    def greetings(self) -> tuple[str, ...]:
        """``first_mes`` followed by the alternate greetings (the "swipes")."""
        return (self.first_mes, *self.alternate_greetings)

    def greeting(self, index: int | None = None, rng: random.Random | None = None) -> str:
        """Greeting ``index`` of :attr:`greetings` (0 is ``first_mes``); with no index, a
        random one when ``rng`` is given, else ``first_mes``. Macros are not expanded."""
        if index is None:
            return rng.choice(self.greetings) if rng is not None else self.first_mes
        if not 0 <= index < len(self.greetings):
            raise CardError(
                f"greeting {index} does not exist; this card has {len(self.greetings)}",
                code="invalid_greeting",
                param="greeting",
            )
        return self.greetings[index]

    def to_json(self) -> dict[str, Any]:
        """The card document as imported (a copy), for export or storage."""
        return copy.deepcopy(self.document)


def parse_card(data: bytes, content_type: str | None = None) -> Card:
    """Import a card upload: PNG when the bytes carry the PNG signature, else JSON."""
    if data.startswith(PNG_SIGNATURE):
        return parse_card_png(data)
    if content_type is not None and content_type.split(";")[0].strip().lower() == "image/png":
        raise CardError("the upload is not a PNG file", code="invalid_png")
    return parse_card_json(data)


def parse_card_json(raw: bytes | str | Mapping[str, Any]) -> Card:
    """Import a V1, V2 or V3 card from JSON text or an already decoded object."""
    if isinstance(raw, bytes | str):
        size = len(raw.encode() if isinstance(raw, str) else raw)
        if size > MAX_CARD_BYTES:
            raise CardError(
                f"the card is {size} bytes; at most {MAX_CARD_BYTES} are accepted",
                code="card_too_large",
            )
        try:
            doc = json.loads(raw.decode("utf-8-sig") if isinstance(raw, bytes) else raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CardError(f"the card is not valid JSON: {exc}") from exc
    else:
        doc = copy.deepcopy(raw)
    if not isinstance(doc, dict):
        raise CardError("a character card must be a JSON object")
    bad = _unencodable(doc, "")
    if bad is not None:
        raise CardError(f"{bad or 'the card'} is not valid Unicode text", param=bad or None)
    return _card_from_document(doc)


def _unencodable(value: Any, path: str) -> str | None:
    """The path of the first string UTF-8 cannot encode (a lone surrogate), if any."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        where = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and _unencodable(key, where) is not None:
            return where
        found = _unencodable(item, where)
        if found is not None:
            return found
    return None


def parse_card_png(data: bytes) -> Card:
    """Import a PNG card from its ``ccv3`` tEXt chunk, else its ``chara`` chunk."""
    if len(data) > MAX_PNG_BYTES:
        raise CardError(
            f"the PNG is {len(data)} bytes; at most {MAX_PNG_BYTES} are accepted",
            code="card_too_large",
        )
    texts = _png_text_chunks(data)
    keyword = "ccv3" if "ccv3" in texts else "chara" if "chara" in texts else None
    if keyword is None:
        raise CardError("the PNG carries no character card (no chara or ccv3 tEXt chunk)")
    try:
        raw = base64.b64decode(texts[keyword], validate=False)
    except (binascii.Error, ValueError) as exc:
        raise CardError(f"the {keyword} chunk is not base64", param=keyword) from exc
    return parse_card_json(raw)


def card_to_png(card_json: Mapping[str, Any], *, chara: Mapping[str, Any] | None = None) -> bytes:
    """A minimal valid PNG (one transparent pixel) carrying ``card_json``.

    A V3 document goes in a ``ccv3`` chunk, anything else in ``chara``; ``chara`` adds a
    V2 fallback beside a V3 card for readers that only know ``chara``.
    """
    texts = {"ccv3" if card_json.get("spec") == SPEC_V3 else "chara": card_json}
    if chara is not None:
        texts.setdefault("chara", chara)
    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 6, 0, 0, 0)  # 1×1, 8-bit RGBA
    out = [PNG_SIGNATURE, _png_chunk(b"IHDR", ihdr)]
    for keyword, doc in texts.items():
        payload = base64.b64encode(json.dumps(doc, ensure_ascii=False).encode())
        out.append(_png_chunk(b"tEXt", keyword.encode("latin-1") + b"\0" + payload))
    out.append(_png_chunk(b"IDAT", zlib.compress(b"\0\0\0\0\0")))  # filter byte + pixel
    out.append(_png_chunk(b"IEND", b""))
    return b"".join(out)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_text_chunks(data: bytes) -> dict[str, bytes]:
    """The card-bearing tEXt chunks of a PNG (first of each keyword), CRC-checked."""
    if not data.startswith(PNG_SIGNATURE):
        raise CardError("not a PNG file (bad signature)", code="invalid_png")
    found: dict[str, bytes] = {}
    pos = len(PNG_SIGNATURE)
    while True:
        if pos + 8 > len(data):
            raise CardError("the PNG is truncated (no IEND chunk)", code="invalid_png")
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        end = pos + 8 + length + 4
        if end > len(data):
            raise CardError(f"the PNG is truncated inside a {kind!r} chunk", code="invalid_png")
        body = data[pos + 8 : end - 4]
        if kind == b"IEND":
            return found
        if kind == b"tEXt":
            keyword, sep, text = body.partition(b"\0")
            name = keyword.decode("latin-1")
            if sep and name in ("chara", "ccv3") and name not in found:
                # Only the chunks we read are CRC-checked: other damage does not matter here.
                if zlib.crc32(kind + body) != struct.unpack(">I", data[end - 4 : end])[0]:
                    raise CardError(f"the {name} chunk fails its CRC", code="invalid_png")
                found[name] = text
        pos = end


def _card_from_document(doc: dict[str, Any]) -> Card:
    spec: Spec
    if doc.get("spec") is None:
        fields, prefix, spec = doc, "", SPEC_V1
    elif doc["spec"] in (SPEC_V2, SPEC_V3):
        spec, data = doc["spec"], doc.get("data")
        if not isinstance(data, dict):
            raise CardError(f"a {spec} card needs a 'data' object", param="data")
        fields, prefix = data, "data."
    else:
        raise CardError(f"unsupported card spec {doc['spec']!r}", param="spec")
    name = _opt(fields, "name", str, prefix)
    if not isinstance(name, str) or not name.strip():
        raise CardError("the card needs a non-empty 'name'", param=prefix + "name")
    _opt(fields, "extensions", dict, prefix)
    text = {key: _opt(fields, key, str, prefix) or "" for key in _PROMPT_FIELDS}
    nickname = _opt(fields, "nickname", str, prefix) if spec == SPEC_V3 else None
    book = fields.get("character_book")
    return Card(
        spec=spec,
        name=name,
        alternate_greetings=_str_list(fields, "alternate_greetings", prefix),
        character_book=None if book is None else _lorebook(book, prefix + "character_book"),
        nickname=nickname or None,
        document=doc,
        **text,
    )


def _lorebook(book: object, path: str) -> Lorebook:
    if not isinstance(book, dict):
        raise CardError(f"'{path}' must be an object", param=path)
    entries = book.get("entries")
    entries = [] if entries is None else entries
    if not isinstance(entries, list):
        raise CardError(f"'{path}.entries' must be an array", param=f"{path}.entries")
    if len(entries) > MAX_LORE_ENTRIES:
        raise CardError(
            f"'{path}.entries' holds at most {MAX_LORE_ENTRIES} entries, not {len(entries)}",
            code="card_too_large",
            param=f"{path}.entries",
        )
    return Lorebook(
        entries=tuple(_lore_entry(e, f"{path}.entries[{i}]") for i, e in enumerate(entries)),
        scan_depth=_opt(book, "scan_depth", int, path + "."),
        token_budget=_opt(book, "token_budget", int, path + "."),
        recursive_scanning=bool(_opt(book, "recursive_scanning", bool, path + ".")),
        name=_opt(book, "name", str, path + "."),
        description=_opt(book, "description", str, path + "."),
        extensions=_opt(book, "extensions", dict, path + ".") or {},
    )


def _lore_entry(entry: object, path: str) -> LoreEntry:
    if not isinstance(entry, dict):
        raise CardError(f"'{path}' must be an object", param=path)
    p = path + "."
    position = _opt(entry, "position", str, p) or "before_char"
    if position not in ("before_char", "after_char"):
        raise CardError(f"'{p}position' must be before_char or after_char", param=p + "position")
    flags = {
        key: bool(_opt(entry, key, bool, p))
        for key in ("case_sensitive", "selective", "constant", "use_regex")
    }
    enabled = _opt(entry, "enabled", bool, p)
    keys = _str_list(entry, "keys", p, commas=True)
    secondary = _str_list(entry, "secondary_keys", p, commas=True)
    for name, found in (("keys", keys), ("secondary_keys", secondary)):
        if len(found) > MAX_LORE_KEYS or any(len(k) > MAX_LORE_KEY_CHARS for k in found):
            raise CardError(
                f"'{p}{name}' holds at most {MAX_LORE_KEYS} keys of at most "
                f"{MAX_LORE_KEY_CHARS} characters",
                code="card_too_large",
                param=p + name,
            )
    return LoreEntry(
        keys=keys,
        content=_opt(entry, "content", str, p) or "",
        enabled=True if enabled is None else enabled,
        insertion_order=_opt(entry, "insertion_order", float, p) or 0,
        secondary_keys=secondary,
        position=position,  # type: ignore[arg-type]  # checked just above
        priority=_opt(entry, "priority", float, p),
        id=_opt(entry, "id", (int, str), p),
        name=_opt(entry, "name", str, p),
        comment=_opt(entry, "comment", str, p),
        extensions=_opt(entry, "extensions", dict, p) or {},
        **flags,
    )


def _opt(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], prefix: str) -> Any:
    """``obj[key]`` when present and not null, checked against ``kind``; else None.

    ``float`` admits ints, ``int`` admits integral floats; ``bool`` never passes as a number.
    """
    value = obj.get(key)
    if value is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, float) and int in kinds and value.is_integer():
        value = int(value)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok and float in kinds and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        names = " or ".join(_JSON_TYPES.get(k, k.__name__) for k in kinds)
        raise CardError(f"'{prefix}{key}' must be {names}", param=prefix + key)
    return value


def _str_list(
    obj: Mapping[str, Any], key: str, prefix: str, *, commas: bool = False
) -> tuple[str, ...]:
    """A list of strings; with ``commas``, a comma-separated string is accepted (V3 lore
    keys may be written that way)."""
    value = obj.get(key)
    if value is None:
        return ()
    if commas and isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CardError(f"'{prefix}{key}' must be an array of strings", param=prefix + key)
    return tuple(value)


_JSON_TYPES: dict[type, str] = {
    str: "a string", int: "an integer", float: "a number", bool: "a boolean", dict: "an object",
}  # fmt: skip
