"""Prompt assembly for a character, the way character frontends (SillyTavern) do it.

A card plus a conversation becomes OpenAI-style messages:

1. one persona system message, its non-empty parts separated by a blank line:
   the system prompt (the card's ``system_prompt``, or the default; ``{{original}}`` in
   the card's expands to the default), lorebook entries placed ``before_char``, the
   description, ``{{char}}'s personality: ...``, ``Scenario: ...``, entries placed
   ``after_char``, and the example dialogue (each ``<START>`` block as ``[Example Chat]``
   followed by its lines);
2. the session's memory (a summary of the turns no longer sent), when there is one, as a
   system message;
3. the history, verbatim;
4. the post-history instructions (the card's, or the default; ``{{original}}`` expands to
   the default) as a final system message, when there are any.

That is the frontend layout (``layout="frontend"``). The default, ``layout="stable"``,
keeps the prompt's long head byte-identical from turn to turn, so the engine's prefix cache
serves it: only ``constant`` lorebook entries stay in the persona (they never change); the
entries a key triggered, which change as the conversation moves, go into the final system
message after the history, before the post-history instructions. A turn then recomputes
only the latest exchange and that final message, where the frontend layout recomputes
everything after the persona's first triggered entry whenever the triggered set changes.
The model reads the triggered entries nearer the end (as SillyTavern's "@ depth 0"
placement puts them), which is the one difference a card author may notice.

A group chat's persona holds every member's description, personality, scenario, constant
entries and examples, each under ``[name]``, in the group's order, after the first
member's system prompt; the speaker's post-history instructions and :data:`GROUP_NUDGE`
follow the history, so a change of speaker changes only the prompt's end.

Macros (``{{char}}``, ``{{user}}``, legacy ``<BOT>``/``<CHAR>``/``<USER>``, any case) are
expanded in every card-derived text, never in the history. ``{{char}}`` is V3's nickname
when the card has one.

Lorebook entries trigger when ``constant``, or when a key occurs in the last
``scan_depth`` history messages (default :data:`DEFAULT_SCAN_DEPTH`; substring match,
case-insensitive unless the entry says otherwise; regex when ``use_regex``, on an engine
with a time bound: all of one assembly's regex keys get :data:`LORE_REGEX_BUDGET_S`, and a
key that runs out of it is no match); a ``selective`` entry with ``secondary_keys`` also
needs one of those; a disabled one never. With ``recursive_scanning`` the content of
triggered entries is scanned too, until nothing new triggers. Over ``token_budget``,
entries are dropped lowest first by (``priority``, falling back to ``insertion_order``
when absent; then ``insertion_order``; then later in the book) until the rest fit. Within
a position they are inserted by ``insertion_order``.
Leading ``@@decorator`` lines of V3 are stripped, not interpreted.

When the prompt is over ``max_prompt_tokens``, the oldest history is dropped first, cutting
only in front of a user message so a user turn and its reply go together; the persona, the
post-history instructions and the latest user message (with anything after it) are never
dropped. If even that is too long, :class:`PromptTooLong`. The cut is found by binary
search: ``count_tokens`` is called O(log n) times, not once per message.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import regex

from cluster.characters.cards import Card, Lorebook, LoreEntry
from cluster.errors import InvalidInput

GROUP_NUDGE = "[Write the next reply only as {{char}}.]"
"""What closes a group chat's prompt: who speaks next (SillyTavern's default wording)."""

DEFAULT_SCAN_DEPTH = 4
LORE_REGEX_BUDGET_S = 0.05
"""Time one assembly may spend matching the regex keys of a lorebook, in all."""
"""History messages scanned for lorebook keys when the book sets no ``scan_depth``."""

Message = dict[str, str]
Layout = Literal["stable", "frontend"]
CountTokens = Callable[[list[Message]], int]
"""Tokens of a rendered conversation (the caller applies the model's chat template)."""

_MACRO = re.compile(r"\{\{(char|user)\}\}|<(bot|char|user)>", re.IGNORECASE)
_START = re.compile(r"<start>", re.IGNORECASE)


class PromptTooLong(InvalidInput):
    """Even with all droppable history gone the prompt exceeds ``max_prompt_tokens``."""

    def __init__(self, prompt_tokens: int, max_prompt_tokens: int) -> None:
        super().__init__(
            f"the prompt needs at least {prompt_tokens} tokens (persona, post-history "
            f"instructions and the latest user message); at most {max_prompt_tokens} fit"
        )
        self.prompt_tokens = prompt_tokens
        self.max_prompt_tokens = max_prompt_tokens


@dataclass(frozen=True, slots=True)
class Assembled:
    """The messages to render, and what assembly left out or put in."""

    messages: list[Message]
    dropped: int
    """How many of the oldest history messages were dropped to fit."""
    lore_entries_used: tuple[LoreEntry, ...]
    prompt_tokens: int
    lore_timed_out: bool = False
    """A regex key ran out of the scan's time (it was taken as no match)."""


def expand_macros(text: str, *, char: str, user: str) -> str:
    """Replace ``{{char}}``/``{{user}}`` and ``<BOT>``/``<CHAR>``/``<USER>``, any case."""
    return _MACRO.sub(lambda m: user if (m[1] or m[2]).lower() == "user" else char, text)


def render_greeting(
    card: Card, *, user_name: str, index: int | None = None, rng: random.Random | None = None
) -> str:
    """The card's greeting ``index`` (see :meth:`Card.greeting`) with macros expanded."""
    return expand_macros(card.greeting(index, rng), char=card.display_name, user=user_name)


def assemble(
    card: Card,
    history: Sequence[Mapping[str, str]],
    *,
    user_name: str,
    default_system_prompt: str,
    count_tokens: CountTokens,
    max_prompt_tokens: int,
    default_post_history_instructions: str = "",
    layout: Layout = "stable",
    memory: str = "",
    group: Sequence[Card] = (),
) -> Assembled:
    """Build the messages for ``card`` and ``history`` within ``max_prompt_tokens``, in
    ``layout`` (see the module's docstring). In a group chat, ``group`` holds every
    member (``card``, the one to speak next, among them): the persona describes them all,
    in the group's order, so it stays the same whoever speaks; the speaker's post-history
    instructions and :data:`GROUP_NUDGE` close the prompt."""

    def macros_of(member: Card) -> Callable[[str], str]:
        return lambda text: expand_macros(text, char=member.display_name, user=user_name).strip()

    members = tuple(group) or (card,)
    scan = _Scan(LORE_REGEX_BUDGET_S)
    lore: tuple[LoreEntry, ...] = ()
    late: list[str] = []
    blocks: list[str] = []
    for member in members:
        macros = macros_of(member)
        triggered = _triggered_lore(member.character_book, history, count_tokens, scan)
        lore += triggered
        fixed = triggered if layout == "frontend" else tuple(e for e in triggered if e.constant)
        late += [macros(_strip_decorators(e.content)) for e in triggered if e not in fixed]
        parts = [
            *(macros(_strip_decorators(e.content)) for e in fixed if e.position == "before_char"),
            macros(member.description),
            macros(_labelled("{{char}}'s personality: ", member.personality)),
            macros(_labelled("Scenario: ", member.scenario)),
            *(macros(_strip_decorators(e.content)) for e in fixed if e.position == "after_char"),
            _examples(macros(member.mes_example)),
        ]
        block = "\n\n".join(part for part in parts if part)
        blocks.append(f"[{member.display_name}]\n{block}" if group and block else block)
    system = macros_of(members[0])(_override(members[0].system_prompt, default_system_prompt))
    persona_text = "\n\n".join(part for part in [system, *blocks] if part)
    head = [{"role": "system", "content": persona_text}] if persona_text else []
    if memory:
        head.append({"role": "system", "content": memory})
    speaker = macros_of(card)
    post = speaker(_override(card.post_history_instructions, default_post_history_instructions))
    nudge = speaker(GROUP_NUDGE) if group else ""
    end = "\n\n".join(part for part in [*late, post, nudge] if part)
    tail = [{"role": "system", "content": end}] if end else []
    turns = [dict(m) for m in history]

    def build(cut: int) -> list[Message]:
        return head + turns[cut:] + tail

    full = count_tokens(build(0))
    if full <= max_prompt_tokens:
        return Assembled(build(0), 0, lore, full, scan.timed_out)
    cuts = _cut_points(turns)
    least = count_tokens(build(cuts[-1]))
    if least > max_prompt_tokens:
        raise PromptTooLong(least, max_prompt_tokens)
    # cuts[0] is too long and cuts[-1] fits: find the first cut that fits.
    lo, hi, best = 1, len(cuts) - 1, (cuts[-1], least)
    while lo < hi:
        mid = (lo + hi) // 2
        tokens = count_tokens(build(cuts[mid]))
        if tokens <= max_prompt_tokens:
            hi, best = mid, (cuts[mid], tokens)
        else:
            lo = mid + 1
    return Assembled(build(best[0]), best[0], lore, best[1], scan.timed_out)


def _override(card_value: str, default: str) -> str:
    """A card field that replaces a default unless blank; ``{{original}}`` is the default."""
    if not card_value.strip():
        return default
    return re.sub(r"\{\{original\}\}", lambda _: default, card_value, flags=re.IGNORECASE)


def _labelled(label: str, text: str) -> str:
    return label + text if text.strip() else ""


def _examples(mes_example: str) -> str:
    blocks = [block.strip() for block in _START.split(mes_example)]
    return "\n\n".join(f"[Example Chat]\n{block}" for block in blocks if block)


def _strip_decorators(content: str) -> str:
    lines = content.split("\n")
    while lines and lines[0].lstrip().startswith("@@"):
        lines.pop(0)
    return "\n".join(lines)


def _cut_points(turns: list[Message]) -> list[int]:
    """Ascending history offsets the kept history may start at; the last one keeps only
    the latest user message and what follows it."""
    users = [i for i, m in enumerate(turns) if m.get("role") == "user"]
    last = users[-1] if users else max(len(turns) - 1, 0)
    return [0, *(i for i in users if 0 < i < last), *([last] if last > 0 else [])]


def _triggered_lore(
    book: Lorebook | None,
    history: Sequence[Mapping[str, str]],
    count_tokens: CountTokens,
    scan: _Scan,
) -> tuple[LoreEntry, ...]:
    """The entries that trigger, within the token budget, in insertion order."""
    if book is None:
        return ()
    depth = DEFAULT_SCAN_DEPTH if book.scan_depth is None else max(book.scan_depth, 0)
    recent = history[max(len(history) - depth, 0) :] if depth else []
    candidates = [e for e in book.entries if e.enabled and _strip_decorators(e.content).strip()]
    active: set[int] = set()
    buffer = "\n".join(m.get("content", "") for m in recent)
    while True:
        new = [
            i
            for i, e in enumerate(candidates)
            if i not in active and (e.constant or _matches(e, buffer, scan))
        ]
        if not new:
            break
        active.update(new)
        if not book.recursive_scanning:
            break
        buffer = "\n".join([buffer, *(candidates[i].content for i in new)])
    if book.token_budget:
        active = set(_within_budget(book.token_budget, active, candidates, count_tokens))
    order = sorted(active, key=lambda i: (candidates[i].insertion_order, i))
    return tuple(candidates[i] for i in order)


def _within_budget(
    budget: int, active: set[int], entries: list[LoreEntry], count_tokens: CountTokens
) -> list[int]:
    """Drop the lowest-ranked entries until the rest fit ``budget`` tokens."""
    base = count_tokens([{"role": "system", "content": ""}])

    def tokens(i: int) -> int:
        content = _strip_decorators(entries[i].content)
        return max(count_tokens([{"role": "system", "content": content}]) - base, 0)

    def rank(i: int) -> tuple[float, float, int]:
        e = entries[i]
        return (e.insertion_order if e.priority is None else e.priority, e.insertion_order, -i)

    kept = sorted(active, key=rank, reverse=True)  # most important first
    sizes = [tokens(i) for i in kept]
    while kept and sum(sizes) > budget:
        kept.pop()
        sizes.pop()
    return kept


def _matches(entry: LoreEntry, text: str, scan: _Scan) -> bool:
    if not _any_key(entry, entry.keys, text, scan):
        return False
    return not (entry.selective and entry.secondary_keys) or _any_key(
        entry, entry.secondary_keys, text, scan
    )


class _Scan:
    """The time one assembly may spend matching regex keys (:data:`LORE_REGEX_BUDGET_S`
    in all): a key that would take longer is no match. Python's ``re`` has no time bound,
    and a catastrophic pattern's cost grows exponentially with the text, so keys run on
    the ``regex`` engine with a timeout."""

    __slots__ = ("deadline", "timed_out")

    def __init__(self, budget_s: float) -> None:
        self.deadline = time.monotonic() + budget_s
        self.timed_out = False

    def search(self, pattern: str, text: str, flags: int) -> bool:
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.timed_out = True
            return False
        try:
            return regex.search(pattern, text, flags, timeout=left) is not None
        except TimeoutError:
            self.timed_out = True
            return False


def _any_key(entry: LoreEntry, keys: tuple[str, ...], text: str, scan: _Scan) -> bool:
    for key in keys:
        if not key.strip():
            continue
        if entry.use_regex:
            flags = 0 if entry.case_sensitive else regex.IGNORECASE
            try:
                if scan.search(key, text, flags):
                    return True
            except regex.error:  # the V3 spec: an invalid pattern is no match
                continue
        elif (key in text) if entry.case_sensitive else (key.casefold() in text.casefold()):
            return True
    return False
