"""Mixtral (`MixtralForCausalLM`): Llama's attention with every layer's MLP a mixture of experts.

Megatron's MoE layer maps to the names transformers 5 writes for a Mixtral checkpoint (it fuses
the experts into `mlp.experts.gate_up_proj` when it loads them, and writes these when it saves):

- `mlp.router.weight` → `block_sparse_moe.gate.weight`;
- `mlp.experts.local_experts.<e>.linear_fc1.weight` ([gate; up]) → `block_sparse_moe.experts.<e>.w1`
  (gate) and `.w3` (up); `linear_fc2.weight` → `.w2`.

The router is the same function: Mixtral takes the softmax over all experts, the top k, and
renormalises them; Megatron's default (`moe_router_pre_softmax=False`) takes the top k of the
logits and a softmax over those k, which is the same probabilities for the same experts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from orchestrator.adapters.megatron.convert.rules import EXPERT, LAYER, MOE, gate_up, same
from orchestrator.models import Family, ModelShape

if TYPE_CHECKING:
    from transformers import MixtralConfig

__all__ = ["RULES", "expert_shapes", "hf_mixtral_config", "moe_names"]

_MOE_BLOCK = "model.layers.{i}.block_sparse_moe."
_FAMILIES = frozenset({Family.MIXTRAL})

RULES = (
    (LAYER + r"mlp\.router\.weight", (_MOE_BLOCK + "gate.weight",), same, MOE, _FAMILIES),
    (
        EXPERT + r"linear_fc1\.weight",
        (_MOE_BLOCK + "experts.{e}.w1.weight", _MOE_BLOCK + "experts.{e}.w3.weight"),
        gate_up,
        MOE,
        _FAMILIES,
    ),
    (EXPERT + r"linear_fc2\.weight", (_MOE_BLOCK + "experts.{e}.w2.weight",), same, MOE, _FAMILIES),
)


def expert_shapes(spec: ModelShape) -> dict[str, tuple[int, ...]]:
    """The shapes of an expert's `w1` (gate), `w3` (up) and `w2` (down), by `hf.hf_shape`'s keys."""
    ffn, hidden = spec.moe_ffn_hidden_size, spec.hidden_size
    return {"expert.w1": (ffn, hidden), "expert.w3": (ffn, hidden), "expert.w2": (hidden, ffn)}


def moe_names(spec: ModelShape) -> list[str]:
    """An MoE layer's MLP names, relative to `model.layers.<i>.`, as `hf_names` lists them."""
    experts = [f"block_sparse_moe.experts.{e}.{w}" for e in range(spec.num_experts) for w in ("w1", "w2", "w3")]
    return ["block_sparse_moe.gate", *experts]


def hf_mixtral_config(spec: ModelShape, common: dict[str, Any]) -> MixtralConfig:
    """`common` is what every family's config shares; Mixtral's `intermediate_size` is an expert's."""
    from transformers import MixtralConfig

    return MixtralConfig(
        **{**common, "intermediate_size": spec.moe_ffn_hidden_size},
        num_local_experts=spec.num_experts,
        num_experts_per_tok=spec.moe_router_topk,
        sliding_window=None,
        router_jitter_noise=0.0,
        output_router_logits=False,
    )
