"""DeepSeek-style MoE layers (DeepSeek-V3, GLM-4.5, GLM-5): Megatron-core's `MoELayer` with a sigmoid
router, `expert_bias`, group-limited top-k, a routed scale and shared experts → HF's
`DeepseekV3MoE` / `Glm4MoeMoE`.

Names: `mlp.router.weight` → `mlp.gate.weight`; the router's fp32 `expert_bias` buffer →
`mlp.gate.e_score_correction_bias`; `mlp.experts.local_experts.<e>.linear_fc1/2` →
`mlp.experts.<e>.{gate,up,down}_proj` (the checkpoint layout, which transformers fuses when it
loads); `mlp.shared_experts.linear_fc1/2` → `mlp.shared_experts.{gate,up,down}_proj`.

The router computes the same on both sides (Megatron's `topk_routing_with_score_function` with
`score_function="sigmoid"`, HF's `DeepseekV3TopkRouter` / `Glm4MoeTopkRouter`):

- scores are sigmoid(logits); the bias is added for choosing only, the weights are the unbiased
  scores of the chosen experts;
- groups: each group is ranked by the sum of its top scores, and the top-k is taken within the
  best `group_topk` groups. Megatron sums the top `topk // group_topk` of a group, HF always the
  top 2, so a grouped model converts only where `topk // group_topk == 2`; without groups HF's
  one group of every expert (`n_group=1`) chooses the same;
- the weights are normalised over the top-k (Megatron does whenever top-k > 1: HF's
  `norm_topk_prob`), then multiplied by the scale (`moe_router_topk_scaling_factor` ↔
  `routed_scaling_factor`);
- the shared experts, one MLP of `moe_shared_expert_intermediate_size` (HF: `n_shared_experts`
  × `moe_intermediate_size`), are added to every token's routed output;
- the MoE layers are the last ones: the first `first_k_dense_replace` are dense.
"""

from __future__ import annotations

from typing import Any

from orchestrator.adapters.megatron.convert.rules import EXPERT, LAYER, MOE, compile_rules, gate_up, same
from orchestrator.models import Family, ModelShape

__all__ = [
    "ROUTED_FAMILIES",
    "RULES",
    "hf_config_keys",
    "megatron_fields",
    "megatron_problems",
    "moe_names",
    "shapes",
    "spec_problems",
]

# The families whose MoE layers route this way.
ROUTED_FAMILIES = frozenset({Family.DEEPSEEK_V3, Family.GLM4_MOE, Family.GLM_MOE_DSA})
HF_GROUP_TOP = 2  # HF ranks a group by the sum of its top 2 biased scores

_MLP = "model.layers.{i}.mlp."
_GATE_UP = ("gate_proj.weight", "up_proj.weight")
RULES = compile_rules(
    (pattern, tuple(_MLP + t for t in targets), split, MOE, ROUTED_FAMILIES)
    for pattern, targets, split in (
        (LAYER + r"mlp\.router\.weight", ("gate.weight",), same),
        (LAYER + r"mlp\.router\.expert_bias", ("gate.e_score_correction_bias",), same),
        (EXPERT + r"linear_fc1\.weight", tuple(f"experts.{{e}}.{p}" for p in _GATE_UP), gate_up),
        (EXPERT + r"linear_fc2\.weight", ("experts.{e}.down_proj.weight",), same),
        (LAYER + r"mlp\.shared_experts\.linear_fc1\.weight", tuple(f"shared_experts.{p}" for p in _GATE_UP), gate_up),
        (LAYER + r"mlp\.shared_experts\.linear_fc2\.weight", ("shared_experts.down_proj.weight",), same),
    )
)


def megatron_fields(config: Any) -> dict[str, Any]:
    """The spec's routing fields from a `TransformerConfig` with experts."""
    if not config.num_moe_experts:
        return {}
    sigmoid = config.moe_router_score_function == "sigmoid"
    return dict(
        moe_score_function=config.moe_router_score_function,
        # Megatron normalises sigmoid weights over the top-k whenever k > 1, softmax ones unless
        # the softmax came before the top-k.
        moe_norm_topk_prob=config.moe_router_topk > 1 if sigmoid else not config.moe_router_pre_softmax,
        moe_shared_ffn_hidden_size=config.moe_shared_expert_intermediate_size or 0,
        moe_router_num_groups=config.moe_router_num_groups or 0,
        moe_router_group_topk=config.moe_router_group_topk or 0,
        moe_routed_scaling_factor=float(config.moe_router_topk_scaling_factor or 1.0),
    )


def megatron_problems(config: Any) -> list[str]:
    """What Megatron's MoE layer computes that no spec field can say."""
    if config.num_moe_experts and config.moe_shared_expert_gate:
        return ["moe_shared_expert_gate (HF's shared experts have no gate)"]
    return []


def spec_problems(spec: ModelShape) -> list[str]:
    """Why a routed family's HF model would compute otherwise than the spec says."""
    if spec.family not in ROUTED_FAMILIES:
        return []
    name = spec.family.value
    if not spec.num_experts or not spec.moe_layers:
        return [f"no MoE layer (HF {name} has them from first_k_dense_replace on)"]
    out = []
    first = min(spec.moe_layers)
    if spec.moe_layers != tuple(range(first, spec.num_layers)):
        out.append(f"MoE layers {list(spec.moe_layers)} (HF {name}'s are every layer from the first one on)")
    if spec.moe_score_function != "sigmoid":
        out.append(f"moe_router_score_function={spec.moe_score_function!r} (HF {name} routes by sigmoid)")
    if not spec.expert_bias:
        out.append("no moe_router_enable_expert_bias (HF's router always adds e_score_correction_bias)")
    shared, routed = spec.moe_shared_ffn_hidden_size, spec.moe_ffn_hidden_size
    if not shared or shared % routed:
        out.append(f"shared experts of ffn {shared} (HF's are n_shared_experts x the experts' ffn {routed})")
    groups = spec.moe_router_num_groups or 1
    if spec.num_experts % groups or spec.num_experts // groups < HF_GROUP_TOP:
        out.append(f"{spec.num_experts} experts in {groups} groups (HF needs groups of {HF_GROUP_TOP} or more)")
    if spec.moe_router_num_groups and spec.moe_router_topk // (spec.moe_router_group_topk or 1) != HF_GROUP_TOP:
        out.append(
            f"moe_router_topk={spec.moe_router_topk} over moe_router_group_topk={spec.moe_router_group_topk} "
            f"(Megatron ranks groups by their top topk // group_topk scores, HF by their top {HF_GROUP_TOP})"
        )
    return out


def shapes(spec: ModelShape) -> dict[str, tuple[int, ...]]:
    """HF shapes by module name (a shared expert's as `shared.<module>`)."""
    hidden, shared = spec.hidden_size, spec.moe_shared_ffn_hidden_size
    return {
        "e_score_correction_bias": (spec.num_experts,),
        "shared.gate_proj": (shared, hidden),
        "shared.up_proj": (shared, hidden),
        "shared.down_proj": (hidden, shared),
    }


def moe_names(spec: ModelShape) -> list[str]:
    """An MoE layer's tensors, as HF names them under `model.layers.<i>.`."""
    experts = [f"mlp.experts.{e}.{p}.weight" for e in range(spec.num_experts) for p in _GATED]
    shared = [f"mlp.shared_experts.{p}.weight" for p in _GATED]
    return ["mlp.gate.weight", "mlp.gate.e_score_correction_bias", *experts, *shared]


def hf_config_keys(spec: ModelShape) -> dict[str, Any]:
    """The HF config keys of the MoE layers (DeepSeek-V3's and GLM-4.5's are the same)."""
    return dict(
        n_routed_experts=spec.num_experts,
        num_experts_per_tok=spec.moe_router_topk,
        moe_intermediate_size=spec.moe_ffn_hidden_size,
        n_shared_experts=spec.moe_shared_ffn_hidden_size // spec.moe_ffn_hidden_size,
        first_k_dense_replace=min(spec.moe_layers),
        n_group=spec.moe_router_num_groups or 1,
        topk_group=spec.moe_router_group_topk or 1,
        routed_scaling_factor=spec.moe_routed_scaling_factor,
        norm_topk_prob=spec.moe_norm_topk_prob,
        num_mtp_layers=0,  # `mtp.hf_config_keys` says otherwise where MTP layers convert
        output_router_logits=False,
    )


_GATED = ("gate_proj", "up_proj", "down_proj")
