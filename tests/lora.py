"""A LoRA adapter for the bundled model, made at test time (code never downloads weights).

:func:`write_adapter` writes PEFT's on-disk format (``adapter_config.json`` and
``adapter_model.safetensors``) targeting the attention projections of SmolLM2-135M, from
a fixed seed, with ``B`` weights large enough that greedy output changes.
"""

from __future__ import annotations

import json
from pathlib import Path

# SmolLM2-135M: 30 layers, hidden 576, 9 query heads and 3 key/value heads of 64.
_LAYERS = 30
_HIDDEN = 576
_OUT = {"q_proj": 576, "v_proj": 192}


def write_adapter(
    path: Path, *, base_model: str, rank: int = 8, seed: int = 1234, scale: float = 0.05
) -> Path:
    """Write a seeded rank-``rank`` LoRA adapter (q_proj, v_proj) to ``path``; return it."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(_LAYERS):
        for module, out in _OUT.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(rank, _HIDDEN, generator=gen) * scale
            b = torch.randn(out, rank, generator=gen) * scale
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(_OUT),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return path
