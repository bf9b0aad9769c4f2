"""A `ModelSpec`'s fields: the shape of a Llama-like GPT, as HF needs it, as plain data.

`SpecFields` is what the family modules (`rules`, `mla`, `routed`, `glm`, `dsa`, `mtp`) read, so
it sits below them and imports none of them. `spec.ModelSpec` is the same fields, checked: its
checks and its constructors call those family modules, so they live above them, in `spec`.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.models import Family

__all__ = ["MEGATRON_LAYERNORM_EPS", "SpecFields"]

# TransformerConfig.layernorm_epsilon's default; HF's configs default to 1e-6.
MEGATRON_LAYERNORM_EPS = 1e-5


@dataclass(frozen=True, kw_only=True)
class SpecFields:
    """The shape of a Llama-like GPT, as HF needs it, unchecked (a `ModelSpec` is checked when
    built). `moe_layers` lists the global indices of the layers whose MLP is a mixture of experts;
    `tie_embeddings`: the output layer is the input embedding (Megatron's
    `share_embeddings_and_output_weights`). The fields after `expert_bias` are what DeepSeek-V3
    (`mla`, `routed`) and GLM-4.5 (`glm`, `routed`) add; 0 means "none"."""

    family: Family
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    max_position_embeddings: int
    rotary_base: float
    layernorm_epsilon: float = MEGATRON_LAYERNORM_EPS
    tie_embeddings: bool = False
    qk_layernorm: bool = False
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    moe_norm_topk_prob: bool = True  # softmax over the top-k (Megatron's default, no pre-softmax)
    moe_layers: tuple[int, ...] = ()
    expert_bias: bool = False
    # GQA attention: biases on q, k and v; the fraction of each head RoPE rotates.
    qkv_bias: bool = False
    rotary_percent: float = 1.0
    # Multi-latent attention: the q latent (0: q projected directly), the kv latent, per-head dims.
    multi_latent_attention: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # YaRN-scaled RoPE (MLA's rope_type="yarn"); factor 0: plain RoPE.
    yarn_factor: float = 0.0
    yarn_original_max_position_embeddings: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    # The router: its score function, shared experts' ffn, group-limited top-k, the weights' scale.
    moe_score_function: str = "softmax"
    moe_shared_ffn_hidden_size: int = 0
    moe_router_num_groups: int = 0
    moe_router_group_topk: int = 0
    moe_routed_scaling_factor: float = 1.0
    # GLM-5: the DSA indexer's heads, head dim and top-k (0: every key is attended); MTP layers.
    dsa_index_n_heads: int = 0
    dsa_index_head_dim: int = 0
    dsa_index_topk: int = 0
    dsa_index_rope_first: bool = False  # megatron-core ≥ 0.19's indexer layout (see `dsa`)
    mtp_num_layers: int = 0
