"""Prompt token ids: the tokenizer's fast backend gives exactly transformers' ids."""

from __future__ import annotations

import pytest

from gateway.chat.prompts import PromptBuilder


@pytest.mark.parametrize(
    "content", ["Introduce yourself.", "héllo ✓ 🚀 <|im_end|> {{char}}", "  spaces\n\nand lines  "]
)
def test_backend_ids_match_transformers(model_path: str, content: str) -> None:
    prompts = PromptBuilder(model_path, 2048, 16)
    assert prompts._backend is not None
    messages = [
        {"role": "system", "content": "You are Mira."},
        {"role": "user", "content": content},
    ]
    fast = prompts.encode(messages)
    text = prompts._tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert fast == list(prompts._tokenizer.encode(text, add_special_tokens=False))
