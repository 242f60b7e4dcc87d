"""Piecewise prompt ids: the same ids as the tokenizer's whole-text encode, kept pieces
bounded, and no piecewise encoding where the tokenizer would cut differently."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from gateway.chat.pieces import PieceEncoder
from gateway.chat.prompts import PromptBuilder

_ALPHABET = [
    *"abc XYZ\n\t.,!?'\"-_<|>im",
    "é",
    "—",
    "🚀",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "\n\n",
    "  ",
    "<|im",
]


@pytest.fixture(scope="module")
def prompts(model_path: str) -> PromptBuilder:
    return PromptBuilder(model_path, 2048, 16)


def _whole(prompts: PromptBuilder, text: str) -> list[int]:
    return list(prompts._backend.encode(text, add_special_tokens=False).ids)


def test_random_texts_get_the_tokenizers_own_ids(prompts: PromptBuilder) -> None:
    pieces = prompts._pieces
    assert pieces is not None, "the bundled model's tokenizer cuts at special tokens only"
    rng = random.Random(18)
    texts = ["".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 80))) for _ in range(600)]
    for text in texts + texts:  # the second time from kept pieces
        assert pieces.encode(text) == _whole(prompts, text), repr(text)
    assert pieces.hits > 0


def test_a_later_turn_encodes_only_its_new_piece(prompts: PromptBuilder) -> None:
    pieces = prompts._pieces
    assert pieces is not None
    pieces.clear()
    persona = "You are Captain Mara Vell, a weathered starship captain. " * 40
    history = [{"role": "system", "content": persona}]
    for turn in range(4):
        history.append({"role": "user", "content": f"Turn {turn}: and the reactor?"})
        before = pieces.misses
        ids = prompts.encode(history)
        text = prompts._tokenizer.apply_chat_template(
            history, tokenize=False, add_generation_prompt=True
        )
        assert ids == _whole(prompts, text)
        if turn > 0:
            # The new user message and the assistant reply before it; the persona and the
            # role headers come from kept pieces.
            assert pieces.misses - before == 2
        history.append({"role": "assistant", "content": f"Reply {turn}: it hums, sailor."})


def test_kept_pieces_are_bounded(model_path: str) -> None:
    backend = PromptBuilder(model_path, 2048, 16)._backend
    pieces = PieceEncoder.of(backend, max_chars=100, max_piece_chars=40)
    assert pieces is not None
    for n in range(20):
        pieces.encode(f"<|im_start|>user\nmessage number {n:04d}<|im_end|>")
        assert pieces.kept_chars <= 100
    long = "x" * 41
    assert pieces.encode(long) == list(backend.encode(long, add_special_tokens=False).ids)
    misses = pieces.misses
    pieces.encode(long)
    assert pieces.misses == misses + 1, "a piece over max_piece_chars is never kept"


def _word_level(special: AddedToken, normalizer: normalizers.Normalizer | None) -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.add_special_tokens([special])
    return tokenizer


def test_piecewise_only_where_it_cuts_as_the_tokenizer_does() -> None:
    plain = _word_level(AddedToken("<s>", special=True), None)
    assert PieceEncoder.of(plain) is not None
    stripping = _word_level(AddedToken("<s>", special=True, lstrip=True), None)
    assert PieceEncoder.of(stripping) is None
    normalized = _word_level(AddedToken("<s>", special=True), normalizers.Lowercase())
    assert PieceEncoder.of(normalized) is None
    assert PieceEncoder.of(None) is None
