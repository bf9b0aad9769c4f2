"""How a whole Megatron tensor splits into its HF parts, and the name patterns the rules share.

A rule (`hf._RULES`, `mixtral.RULES`) is (Megatron name pattern, HF names with {i} for the
layer and {e} for the expert, how to split, the layer kind, the families that have it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from orchestrator.adapters.megatron.convert.spec import ModelSpec

__all__ = ["ANY", "DENSE", "EXPERT", "LAYER", "MOE", "Split", "same", "split_fc1", "split_qkv"]

Split = Callable[[torch.Tensor, ModelSpec], list[torch.Tensor]]

LAYER = r"decoder\.layers\.(?P<i>\d+)\."
EXPERT = LAYER + r"mlp\.experts\.local_experts\.(?P<e>\d+)\."
DENSE, MOE, ANY = "dense", "moe", "any"  # which layers a rule's tensor belongs to


def split_qkv(tensor: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
    """Megatron interleaves per query group: [q of nh/ng heads, k, v] for each group in turn."""
    groups, head_dim = spec.num_query_groups, spec.head_dim
    heads_per_group = spec.num_attention_heads // groups
    grouped = tensor.view(groups, (heads_per_group + 2) * head_dim, spec.hidden_size)
    q, k, v = grouped.split([heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return [part.reshape(-1, spec.hidden_size) for part in (q, k, v)]


def split_fc1(tensor: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
    """SwiGLU's fc1 is cat([gate, up]) along the output rows."""
    gate, up = tensor.chunk(2, dim=0)
    return [gate, up]


def same(tensor: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
    return [tensor]
