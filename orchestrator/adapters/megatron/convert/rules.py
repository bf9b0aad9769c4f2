"""The vocabulary every family's name rules are written in (`hf` holds Llama's, Qwen3's and
Qwen3-MoE's; `mla`, `routed` and `glm` the ones their families add).

A rule is `(Megatron name pattern, HF names, split, layer kind, families)`: a whole Megatron
tensor whose name matches becomes the HF names (`{i}` the global layer, `{e}` the global expert),
its tensor split into them by `split`, in the layers of `kind` of the `families` that have it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch

from orchestrator.models import Family, ModelShape

__all__ = [
    "ANY",
    "DENSE",
    "EXPERT",
    "LAYER",
    "MOE",
    "MTP",
    "Rule",
    "Split",
    "compile_rules",
    "gate_up",
    "same",
    "split_qkv",
]

Split = Callable[[torch.Tensor, ModelShape], list[torch.Tensor]]
Rule = tuple[re.Pattern[str], tuple[str, ...], Split, str, frozenset[Family]]

LAYER = r"decoder\.layers\.(?P<i>\d+)\."
EXPERT = LAYER + r"mlp\.experts\.local_experts\.(?P<e>\d+)\."
DENSE, MOE, ANY, MTP = "dense", "moe", "any", "mtp"  # which layers a rule's tensor belongs to


def same(tensor: torch.Tensor, spec: ModelShape) -> list[torch.Tensor]:
    """The HF tensor is the Megatron tensor, as it is."""
    return [tensor]


def gate_up(tensor: torch.Tensor, spec: ModelShape) -> list[torch.Tensor]:
    """SwiGLU's fc1 is cat([gate, up]) along the output rows."""
    gate, up = tensor.chunk(2, dim=0)
    return [gate, up]


def split_qkv(tensor: torch.Tensor, spec: ModelShape) -> list[torch.Tensor]:
    """Megatron interleaves per query group: [q of nh/ng heads, k, v] for each group in turn."""
    groups, head_dim = spec.num_query_groups, spec.kv_channels
    heads_per_group = spec.num_attention_heads // groups
    grouped = tensor.view(groups, (heads_per_group + 2) * head_dim, spec.hidden_size)
    q, k, v = grouped.split([heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return [part.reshape(-1, spec.hidden_size) for part in (q, k, v)]


def compile_rules(
    raw: Iterable[tuple[str, tuple[str, ...], Split, str, Iterable[Family]]],
) -> tuple[Rule, ...]:
    """Rules with their patterns compiled to match whole names."""
    return tuple(
        (re.compile(pattern + r"$"), targets, split, kind, frozenset(families))
        for pattern, targets, split, kind, families in raw
    )
