"""The Megatron-core `TransformerConfig` of a model of any family colocate converts, from its
`ModelShape`: the inverse of `convert.shape_from_megatron` (tests hold the two to each other).

    config = megatron_config(read_config(hf_config_json, source="..."))
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig

from orchestrator.models import ModelShape

__all__ = ["DSA_INDEXER_LOSS_COEFF", "UNFUSED", "block_keys", "megatron_config"]

# TransformerConfig flags off: fusions need apex/TE or CUDA kernels; unfused is also what HF computes.
UNFUSED: dict[str, bool] = dict(
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
    persist_layer_norm=False,
)


def block_keys() -> dict[str, Any]:
    """What every GPT colocate builds shares: RMSNorm, SwiGLU, no linear bias or dropout, bf16
    params, unfused, initialised on the CPU where this process has no GPU."""
    return dict(
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        **UNFUSED,
    )


# GLM-5's indexer learns from its KL loss against the attention it selects for; Megatron's default
# (None) trains no indexer at all, and a random one would pick the keys for good.
DSA_INDEXER_LOSS_COEFF = 0.1


def megatron_config(shape: ModelShape, *, init_method_std: float = 0.02) -> TransformerConfig:
    """The `TransformerConfig` (`MLATransformerConfig` for MLA) of a model of any family colocate
    converts: what `convert.shape_from_megatron` reads back as `shape` (tests hold the two to
    each other), on the CPU path where this process has no GPU."""
    from megatron.core.transformer import MLATransformerConfig

    keys: dict[str, Any] = dict(
        # As initialize_model_parallel made it: Megatron's layers and checks read the config's.
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        # every layer MoE: Megatron still sizes a dense MLP it never builds
        ffn_hidden_size=shape.ffn_hidden_size or shape.moe_ffn_hidden_size,
        layernorm_epsilon=shape.layernorm_epsilon,
        # MLA's q and kv latent norms, which HF always builds: Megatron's local MLA only with this
        qk_layernorm=shape.qk_layernorm or shape.mla,
        add_qkv_bias=shape.qkv_bias,
        init_method_std=init_method_std,
        mtp_num_layers=shape.mtp_num_layers or None,
        **block_keys(),
    )
    if shape.num_experts:
        keys |= _routing(shape)
    if not shape.mla:
        return TransformerConfig(**keys, kv_channels=shape.kv_channels)
    keys |= dict(
        q_lora_rank=shape.q_lora_rank or None,
        kv_lora_rank=shape.kv_lora_rank,
        qk_head_dim=shape.qk_nope_head_dim,
        qk_pos_emb_head_dim=shape.qk_rope_head_dim,
        v_head_dim=shape.v_head_dim,
        rotary_base=shape.rotary_base,
        rotary_percent=shape.rotary_percent,
        beta_fast=shape.yarn_beta_fast,
        beta_slow=shape.yarn_beta_slow,
        mscale=shape.yarn_mscale,
        mscale_all_dim=shape.yarn_mscale_all_dim,
    )
    if shape.yarn:
        keys |= dict(
            rope_type="yarn",
            rotary_scaling_factor=shape.rope_factor,
            original_max_position_embeddings=shape.yarn_original_max_position_embeddings,
        )
    else:  # Megatron's MLA scales its softmax by mscale whatever the RoPE; HF only under YaRN
        keys |= dict(rope_type="rope", rotary_scaling_factor=1.0)
    if shape.dsa_index_n_heads:
        keys |= dict(
            experimental_attention_variant="dsa",
            dsa_indexer_n_heads=shape.dsa_index_n_heads,
            dsa_indexer_head_dim=shape.dsa_index_head_dim,
            dsa_indexer_topk=shape.dsa_index_topk,
            dsa_indexer_loss_coeff=DSA_INDEXER_LOSS_COEFF,
            **_indexer_rope_interleaved(MLATransformerConfig),
        )
    return MLATransformerConfig(**keys)


def _routing(shape: ModelShape) -> dict[str, Any]:
    """The MoE keys of `megatron_config`: `convert.routed.megatron_fields` read backwards."""
    softmax = shape.moe_score_function == "softmax"
    return dict(
        num_moe_experts=shape.num_experts,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
        moe_router_topk=shape.moe_router_topk,
        moe_layer_freq=[int(i in shape.moe_layers) for i in range(shape.num_layers)],
        moe_router_score_function=shape.moe_score_function,
        moe_router_enable_expert_bias=shape.expert_bias,
        # softmax then top-k without renormalising: Megatron's pre-softmax router
        moe_router_pre_softmax=softmax and not shape.moe_norm_topk_prob,
        moe_shared_expert_intermediate_size=shape.moe_shared_ffn_hidden_size or None,
        moe_shared_expert_gate=shape.shared_expert_gate,
        moe_router_num_groups=shape.moe_router_num_groups or None,
        moe_router_group_topk=shape.moe_router_group_topk or None,
        moe_router_topk_scaling_factor=None
        if shape.moe_routed_scaling_factor == 1.0
        else shape.moe_routed_scaling_factor,
        moe_router_dtype="fp32",  # HF routes in fp32
        moe_router_load_balancing_type="none",
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
    )


def _indexer_rope_interleaved(config_class: type) -> dict[str, Any]:
    """megatron-core 0.19 asks whether the indexer's RoPE interleaves (0.16 to 0.18 always do, as
    MLA's): HF's glm_moe_dsa indexer's does."""
    import dataclasses

    names = {field.name for field in dataclasses.fields(config_class)}
    return {"dsa_indexer_rope_interleaved": True} if "dsa_indexer_rope_interleaved" in names else {}
