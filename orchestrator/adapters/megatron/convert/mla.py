"""Multi-latent attention (MLA) and its YaRN RoPE: Megatron-core's `MLASelfAttention` → HF
DeepSeek-V3's `DeepseekV3Attention`.

The two hold the same matrices in the same layouts, so every tensor maps as it is:

| Megatron `self_attention.` | HF `self_attn.` | rows, both sides |
| --- | --- | --- |
| `linear_q_proj` (no `q_lora_rank`) | `q_proj` | per head `[qk_nope; qk_rope]` |
| `linear_q_down_proj` | `q_a_proj` | `q_lora_rank` |
| `q_layernorm` (TE: `linear_q_up_proj.layer_norm_weight`) | `q_a_layernorm` | RMSNorm over the q latent |
| `linear_q_up_proj` | `q_b_proj` | per head `[qk_nope; qk_rope]` |
| `linear_kv_down_proj` | `kv_a_proj_with_mqa` | `[kv latent; the one rope key all heads share]` |
| `kv_layernorm` (TE: `linear_kv_up_proj.layer_norm_weight`) | `kv_a_layernorm` | RMSNorm over the kv latent |
| `linear_kv_up_proj` | `kv_b_proj` | per head `[k_nope; v]` |
| `linear_proj` | `o_proj` | `hidden` (columns: per head `v`) |

Under TP, the local spec makes every projection but `linear_proj` a `ColumnParallelLinear`
(the down projections too: their outputs are gathered before the norm), so their shards
concatenate along dim 0 (per-head rows stay whole heads); the TE spec replicates the down
projections. Either way `gather` makes them whole from the params' own `partition_dim`.

RoPE. Megatron rotates MLA's rope dims as interleaved pairs: `_apply_rotary_pos_emb_bshd` with
`multi_latent_attention` takes the even then the odd dims and rotates those halves; HF's
`rope_interleave=True` (`apply_rotary_pos_emb_interleave`) computes the same. YaRN: both build
the frequencies from `beta_fast`/`beta_slow`'s ramp over `original_max_position_embeddings` with
the same formula, scale cos and sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim)
(HF's `attention_factor`, inferred from the two when both are set), and scale the softmax by
mscale(factor, mscale_all_dim)² over sqrt(qk head dim) (HF's `yarn_apply_mscale`).

A family whose attention is MLA joins `MLA_FAMILIES` (its Megatron names then map by `RULES`,
its spec is checked by `spec_problems`) and builds its HF config with `hf_config_keys`:

    names = mla.attention_names(spec)            # per layer, under model.layers.<i>.
    config = DeepseekV3Config(**{**common, **mla.hf_config_keys(spec)})
"""

from __future__ import annotations

from typing import Any

from orchestrator.adapters.megatron.convert.rules import ANY, LAYER, compile_rules, same
from orchestrator.models import Family, ModelShape

__all__ = [
    "MLA_FAMILIES",
    "MLA_NORM_EPS",
    "RULES",
    "attention_names",
    "hf_config_keys",
    "megatron_fields",
    "megatron_problems",
    "rope_parameters",
    "shapes",
    "spec_problems",
]

# The families whose attention is MLA.
MLA_FAMILIES = frozenset({Family.DEEPSEEK_V3, Family.GLM_MOE_DSA})
# HF builds `q_a_layernorm` and `kv_a_layernorm` with their default eps, not the config's.
MLA_NORM_EPS = 1e-6

_ATTN = LAYER + r"self_attention\."
_HF = "model.layers.{i}.self_attn."
RULES = compile_rules(
    (_ATTN + pattern, (_HF + target,), same, ANY, MLA_FAMILIES)
    for pattern, target in (
        (r"linear_q_proj\.weight", "q_proj.weight"),
        (r"linear_q_down_proj\.weight", "q_a_proj.weight"),
        (r"(?:q_layernorm\.weight|linear_q_up_proj\.layer_norm_weight)", "q_a_layernorm.weight"),
        (r"linear_q_up_proj\.weight", "q_b_proj.weight"),
        (r"linear_kv_down_proj\.weight", "kv_a_proj_with_mqa.weight"),
        (r"(?:kv_layernorm\.weight|linear_kv_up_proj\.layer_norm_weight)", "kv_a_layernorm.weight"),
        (r"linear_kv_up_proj\.weight", "kv_b_proj.weight"),
    )
)


def megatron_fields(config: Any) -> dict[str, Any]:
    """The spec's MLA and RoPE fields from an `MLATransformerConfig`; none for other attention.
    MLA builds its RoPE from the config (not from `GPTModel`'s arguments), so the config is what
    the model computes."""
    if not getattr(config, "multi_latent_attention", False):
        return {}
    yarn = config.rope_type == "yarn"
    return dict(
        num_query_groups=config.num_attention_heads,  # every head has its own k and v
        q_lora_rank=config.q_lora_rank or 0,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_head_dim,
        qk_rope_head_dim=config.qk_pos_emb_head_dim,
        v_head_dim=config.v_head_dim,
        rotary_base=float(config.rotary_base),
        rotary_percent=1.0 if yarn else float(config.rotary_percent),  # YaRN rotates every rope dim
        rotary_interleaved=True,  # MLA rotates interleaved pairs (see RoPE above)
        rope_scaling="yarn" if yarn else "",
        rope_factor=float(config.rotary_scaling_factor) if yarn else 1.0,
        yarn_original_max_position_embeddings=config.original_max_position_embeddings if yarn else 0,
        yarn_beta_fast=float(config.beta_fast),
        yarn_beta_slow=float(config.beta_slow),
        yarn_mscale=float(config.mscale),
        yarn_mscale_all_dim=float(config.mscale_all_dim),
    )


def megatron_problems(config: Any) -> list[str]:
    """What Megatron's MLA computes that no spec field can say."""
    if not getattr(config, "multi_latent_attention", False):
        return []
    # MLA multiplies its softmax scale by mscale(factor, mscale_all_dim)² whatever its rope_type;
    # HF does only for YaRN.
    unscaled_rope = config.rope_type != "yarn" and config.rotary_scaling_factor > 1 and config.mscale_all_dim
    return ["rope_type='rope' with mscale_all_dim (Megatron still scales the softmax by it)"] if unscaled_rope else []


def spec_problems(spec: ModelShape) -> list[str]:
    """Why an MLA family's HF model would compute otherwise than the spec says."""
    if spec.family not in MLA_FAMILIES:
        return []
    if not spec.mla:
        return [f"no multi_latent_attention (HF {spec.family.value}'s attention is MLA)"]
    out = []
    if not spec.qk_layernorm:
        out.append("no qk_layernorm (Megatron's local MLA normalises its q and kv latents only with it)")
    if spec.layernorm_epsilon != MLA_NORM_EPS:
        out.append(f"layernorm_epsilon={spec.layernorm_epsilon:g} (HF's q_a/kv_a norms use {MLA_NORM_EPS:g})")
    if spec.yarn and spec.yarn_mscale != 1.0 and not spec.yarn_mscale_all_dim:
        out.append("YaRN mscale without mscale_all_dim (HF then scales cos and sin by mscale 1)")
    if spec.yarn and not (spec.yarn_beta_fast and spec.yarn_beta_slow):
        out.append("YaRN beta_fast or beta_slow 0 (HF reads 0 as its default)")
    return out


def shapes(spec: ModelShape) -> dict[str, tuple[int, ...]]:
    """HF shapes by module name; they replace GQA's `q_proj` and `o_proj`."""
    if not spec.mla:
        return {}
    hidden, heads = spec.hidden_size, spec.num_attention_heads
    q_head = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    return {
        "q_proj": (heads * q_head, hidden),
        "q_a_proj": (spec.q_lora_rank, hidden),
        "q_a_layernorm": (spec.q_lora_rank,),
        "q_b_proj": (heads * q_head, spec.q_lora_rank),
        "kv_a_proj_with_mqa": (spec.kv_lora_rank + spec.qk_rope_head_dim, hidden),
        "kv_a_layernorm": (spec.kv_lora_rank,),
        "kv_b_proj": (heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank),
        "o_proj": (hidden, heads * spec.v_head_dim),
    }


def attention_names(spec: ModelShape) -> list[str]:
    """A layer's attention tensors, as HF names them under `model.layers.<i>.`."""
    q = ["q_a_proj", "q_a_layernorm", "q_b_proj"] if spec.q_lora_rank else ["q_proj"]
    modules = [*q, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    return [f"self_attn.{module}.weight" for module in modules]


def rope_parameters(spec: ModelShape) -> dict[str, Any]:
    """HF's `rope_parameters`: YaRN's keys where the spec has a YaRN factor."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rotary_base}
    if not spec.yarn:
        return rope
    return rope | {
        "rope_type": "yarn",
        "factor": spec.rope_factor,
        "original_max_position_embeddings": spec.yarn_original_max_position_embeddings,
        "beta_fast": spec.yarn_beta_fast,
        "beta_slow": spec.yarn_beta_slow,
        "mscale": spec.yarn_mscale,
        "mscale_all_dim": spec.yarn_mscale_all_dim,
    }


def hf_config_keys(spec: ModelShape) -> dict[str, Any]:
    """The DeepSeek-V3 config keys of the attention."""
    return dict(
        q_lora_rank=spec.q_lora_rank or None,
        kv_lora_rank=spec.kv_lora_rank,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim,
        # HF's rotary embedding rotates `head_dim` dims: MLA's rope part (a `head_dim` given to the
        # config would otherwise stay and widen it).
        head_dim=spec.qk_rope_head_dim,
        num_key_value_heads=spec.num_attention_heads,
        rope_interleave=True,
        rope_parameters=rope_parameters(spec),
        attention_bias=False,
    )
