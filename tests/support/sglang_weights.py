"""The few weights the SGLang stand-in serves in the contract tests, and random values for them."""

from __future__ import annotations

import torch

from states import EngineMemory

WEIGHTS = {
    "model.embed_tokens.weight": ((32, 8), torch.bfloat16),
    "model.layers.0.self_attn.q_proj.weight": ((8, 8), torch.bfloat16),
    "model.norm.weight": ((8,), torch.float32),
    "lm_head.weight": ((32, 8), torch.bfloat16),
}
ALL = frozenset(EngineMemory)


def tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(shape, generator=gen).to(dtype)) for name, (shape, dtype) in WEIGHTS.items()]
