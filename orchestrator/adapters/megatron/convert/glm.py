"""GLM-4.5's attention beyond Llama's: q/k/v biases, a partial rotary and an optional q/k norm
(Megatron `add_qkv_bias`, `rotary_percent`, `qk_layernorm` → HF `Glm4MoeAttention`'s
`attention_bias`, `partial_rotary_factor`, `use_qk_norm`). Its MoE layers are `routed`'s.

- `linear_qkv.bias` is laid out as the weight's rows, per query group `[q heads, k, v]`, and is
  split the same way into `q_proj.bias`, `k_proj.bias`, `v_proj.bias`; TP shards hold whole
  groups, as for the weight. The output projection has no bias on either side.
- Both rotate the first `rotary_percent` of each head with the non-interleaved (rotate-half)
  RoPE and pass the rest through: Megatron's `_apply_rotary_pos_emb_bshd` on `t[..., :rot_dim]`,
  HF glm4_moe's `apply_rotary_pos_emb` on `q[..., :rotary_dim]`; the frequencies are
  base^(-2j / rot_dim) on both, with rot_dim = int(head_dim · fraction).
- The q/k norm is per head and before RoPE on both (`q_layernorm` → `q_norm`).
"""

from __future__ import annotations

from typing import Any

import torch

from orchestrator.adapters.megatron.convert.rules import ANY, LAYER, compile_rules, same
from orchestrator.models import Family, ModelShape

__all__ = ["PARTIAL_ROTARY_FAMILIES", "QKV_BIAS_FAMILIES", "RULES", "hf_config_keys", "spec_problems", "split_qkv_bias"]

QKV_BIAS_FAMILIES = frozenset({Family.GLM4_MOE})
PARTIAL_ROTARY_FAMILIES = frozenset({Family.GLM4_MOE})


def split_qkv_bias(tensor: torch.Tensor, spec: ModelShape) -> list[torch.Tensor]:
    """Per query group `[q of nh/ng heads, k, v]`, as `linear_qkv.weight`'s rows."""
    groups, head_dim = spec.num_query_groups, spec.kv_channels
    heads_per_group = spec.num_attention_heads // groups
    grouped = tensor.view(groups, (heads_per_group + 2) * head_dim)
    q, k, v = grouped.split([heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return [part.reshape(-1) for part in (q, k, v)]


_ATTN = LAYER + r"self_attention\."
_HF = "model.layers.{i}.self_attn."
RULES = compile_rules(
    (
        (
            _ATTN + r"linear_qkv\.bias",
            tuple(f"{_HF}{p}_proj.bias" for p in "qkv"),
            split_qkv_bias,
            ANY,
            QKV_BIAS_FAMILIES,
        ),
        (_ATTN + r"q_layernorm\.weight", (_HF + "q_norm.weight",), same, ANY, {Family.GLM4_MOE}),
        (_ATTN + r"k_layernorm\.weight", (_HF + "k_norm.weight",), same, ANY, {Family.GLM4_MOE}),
    )
)


def spec_problems(spec: ModelShape) -> list[str]:
    """Why HF would rotate other dims than Megatron does."""
    rotated = spec.kv_channels * spec.rotary_percent
    if spec.family in PARTIAL_ROTARY_FAMILIES and (rotated != int(rotated) or int(rotated) % 2):
        return [f"rotary_percent={spec.rotary_percent:g} of head_dim {spec.kv_channels} is not an even width"]
    return []


def hf_config_keys(spec: ModelShape) -> dict[str, Any]:
    """The GLM-4.5 config keys of the attention."""
    return dict(
        attention_bias=spec.qkv_bias,
        use_qk_norm=spec.qk_layernorm,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": spec.rotary_base,
            "partial_rotary_factor": spec.rotary_percent,
        },
    )
