"""The trainer's side of a published model: the megatron-core `TransformerConfig` a user builds from
its HF `config.json` (the way slime's and Megatron-LM's model scripts set their flags), and the
`ModelShape` the converter reads from it (`megatron_shape`, what `served_problems` compares).

Only the config is built, not the model: at published widths it is a dataclass. What `GPTModel`
would add (vocab, positions, tied embeddings, its RoPE) comes from a stand-in that holds
Megatron's own `RotaryEmbedding`. MTP layers are built only for the family whose converter maps
them (GLM-5's); the HF classes of DeepSeek-V3 and GLM-4.5 build none either.

Megatron's own conventions, where the two differ: no grouped routing is `moe_router_num_groups`
None (HF: `n_group` 1); the shared experts are one MLP of their summed width; MLA's latent norms
are `qk_layernorm`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from orchestrator.adapters.megatron.convert.spec import megatron_shape
from orchestrator.models import Family, ModelShape

__all__ = ["megatron_config", "trainer_shape"]


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return {"rope_theta": hf.get("rope_theta"), **rope}


def megatron_config(hf: dict[str, Any], family: Family) -> Any:
    import torch.nn.functional as F
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    rope = _rope(hf)
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    kw: dict[str, Any] = dict(
        num_layers=layers,
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads", heads),
        ffn_hidden_size=hf["intermediate_size"],
        layernorm_epsilon=hf["rms_norm_eps"],
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    if family in (Family.QWEN3, Family.GLM4_MOE):
        kw |= dict(kv_channels=hf["head_dim"], qk_layernorm=hf.get("use_qk_norm", family is Family.QWEN3))
        kw |= dict(add_qkv_bias=hf.get("attention_bias", False))
    if "n_routed_experts" in hf:
        dense, groups = hf["first_k_dense_replace"], hf.get("n_group", 1)
        kw |= dict(
            num_moe_experts=hf["n_routed_experts"],
            moe_ffn_hidden_size=hf["moe_intermediate_size"],
            moe_router_topk=hf["num_experts_per_tok"],
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_num_groups=groups if groups > 1 else None,
            moe_router_group_topk=hf["topk_group"] if groups > 1 else None,
            moe_router_topk_scaling_factor=hf["routed_scaling_factor"],
            moe_shared_expert_intermediate_size=hf["n_shared_experts"] * hf["moe_intermediate_size"],
            moe_layer_freq=[0] * dense + [1] * (layers - dense),
            moe_router_load_balancing_type="none",
        )
    if "kv_lora_rank" not in hf:
        return TransformerConfig(**kw)
    yarn = (rope.get("rope_type") or rope.get("type")) == "yarn"
    kw |= dict(
        num_query_groups=heads,
        qk_layernorm=True,
        rotary_base=rope["rope_theta"],  # MLA's RoPE is its config's, GQA's its GPTModel's
        q_lora_rank=hf["q_lora_rank"],
        kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        rope_type="yarn" if yarn else "rope",
        rotary_scaling_factor=float(rope["factor"]) if yarn else 1.0,
        original_max_position_embeddings=rope.get("original_max_position_embeddings", 4096),
        beta_fast=rope.get("beta_fast", 32),
        beta_slow=rope.get("beta_slow", 1),
        mscale=rope.get("mscale", 1.0),
        mscale_all_dim=rope.get("mscale_all_dim", 0.0) if yarn else 0.0,
    )
    if family is Family.GLM_MOE_DSA:
        kw |= dict(
            experimental_attention_variant="dsa",
            dsa_indexer_n_heads=hf["index_n_heads"],
            dsa_indexer_head_dim=hf["index_head_dim"],
            dsa_indexer_topk=hf["index_topk"],
            mtp_num_layers=hf.get("num_nextn_predict_layers", 0),
        )
    return MLATransformerConfig(**kw)


def trainer_shape(hf: dict[str, Any], family: Family) -> ModelShape:
    """The shape the converter reads from the Megatron model built from `hf` (its refusals aside:
    `shape_from_megatron` applies them; the comparison with a served config is this)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    config = megatron_config(hf, family)
    rope = _rope(hf)
    rope_theta = rope["rope_theta"]
    partial = float(rope.get("partial_rotary_factor") or hf.get("partial_rotary_factor", 1.0))
    gpt = SimpleNamespace(
        vocab_size=hf["vocab_size"],
        max_sequence_length=hf["max_position_embeddings"],
        position_embedding_type="rope",
        share_embeddings_and_output_weights=hf.get("tie_word_embeddings", False),
        rotary_pos_emb=None
        if config.multi_latent_attention
        else RotaryEmbedding(
            config.kv_channels, rotary_percent=partial, rotary_base=rope_theta, use_cpu_initialization=True
        ),
        rotary_base=rope_theta,
        rotary_percent=partial,
    )
    return megatron_shape(config, gpt, family)
