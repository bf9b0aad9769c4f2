"""The transformers config whose model computes what a Megatron GPT computes, per family.

config = hf_config(shape_from_megatron(config, gpt))   # or hf_config(tiny_gpt_config)
model = AutoModelForCausalLM.from_config(config)           # transformers' own class
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from orchestrator.adapters.megatron.convert import dsa, glm, mixtral, mla, routed
from orchestrator.adapters.megatron.convert import mtp as mtp_layers
from orchestrator.adapters.megatron.convert.spec import Family, checked
from orchestrator.adapters.megatron.gpt import GPTConfig, TinyGPTConfig
from orchestrator.models import ModelShape

if TYPE_CHECKING:
    from transformers import LlamaConfig, PretrainedConfig

__all__ = ["ATTN_IMPLEMENTATION", "Shape", "as_spec", "hf_config", "hf_llama_config", "served_hf_config"]

# Neither attention is bit-exact against Megatron's bf16 forward: their logits differ by rounding
# (docs/conversion.md, "Checked against transformers, through the lifecycle"). On CPU, sdpa came
# out slightly closer (mean abs logit difference 0.0069 vs 0.0070, max 0.04-0.05 vs 0.04-0.06,
# logits of mean magnitude 0.8) and is faster, so the engine uses it.
ATTN_IMPLEMENTATION = "sdpa"

Shape = TinyGPTConfig | ModelShape


def as_spec(cfg: Shape) -> ModelShape:
    """The conversion's shape: `cfg` itself, or the job's tiny GPT's (`TinyGPTConfig.shape`); refused
    (ValueError) where its HF family would compute otherwise (`spec.checked`)."""
    return checked(cfg if isinstance(cfg, ModelShape) else cfg.shape())


def served_hf_config(served: Mapping[str, Any]) -> PretrainedConfig:
    """The transformers config of an HF `config.json`'s mapping, as `AutoConfig` reads the file: its
    `model_type`'s config class, in bf16, with the engine's attention."""
    import transformers

    config_class = type(transformers.AutoConfig.for_model(str(served["model_type"])))
    return config_class.from_dict(dict(served), dtype=torch.bfloat16, attn_implementation=ATTN_IMPLEMENTATION)


def hf_config(cfg: Shape | GPTConfig) -> PretrainedConfig:
    """The transformers config whose model computes what the Megatron GPT computes, in bf16: a
    family model's is the config it serves (`GPTConfig.served`), which the trainer checks."""
    import transformers

    if isinstance(cfg, GPTConfig):
        return served_hf_config(cfg.served)
    spec = as_spec(cfg)
    common: dict[str, Any] = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.ffn_hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_query_groups,
        head_dim=spec.kv_channels,
        hidden_act="silu",
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.layernorm_epsilon,
        # transformers 5.x moved the theta into `rope_parameters`; Megatron's default RoPE is
        # the non-interleaved (rotate-half) one, which is HF's "default".
        rope_parameters={"rope_type": "default", "rope_theta": spec.rotary_base},
        tie_word_embeddings=spec.tie_embeddings,
        attention_bias=False,
        attention_dropout=0.0,
        dtype=torch.bfloat16,
        # Taken through the config's **kwargs, which transformers 5's dataclass signature hides.
        attn_implementation=ATTN_IMPLEMENTATION,
    )
    if spec.family is Family.LLAMA:
        return transformers.LlamaConfig(**common, mlp_bias=False)
    if spec.family is Family.QWEN3:
        return transformers.Qwen3Config(**common, use_sliding_window=False)
    if spec.family is Family.MIXTRAL:
        return mixtral.hf_mixtral_config(spec, common)
    if spec.family is Family.DEEPSEEK_V3:
        return transformers.DeepseekV3Config(**{**common, **mla.hf_config_keys(spec), **routed.hf_config_keys(spec)})
    if spec.family is Family.GLM_MOE_DSA:
        keys = (
            mla.hf_config_keys(spec)
            | routed.hf_config_keys(spec)
            | dsa.hf_config_keys(spec)
            | mtp_layers.hf_config_keys(spec)
        )
        return transformers.GlmMoeDsaConfig(**{**common, **keys})
    if spec.family is Family.GLM4_MOE:
        return transformers.Glm4MoeConfig(**{**common, **glm.hf_config_keys(spec), **routed.hf_config_keys(spec)})
    return transformers.Qwen3MoeConfig(
        **common,
        use_sliding_window=False,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.moe_router_topk,
        moe_intermediate_size=spec.moe_ffn_hidden_size,
        norm_topk_prob=spec.moe_norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(spec.num_layers) if i not in spec.moe_layers],
        output_router_logits=False,
    )


def hf_llama_config(cfg: Shape) -> LlamaConfig:
    """The `LlamaConfig` that computes what Megatron's dense GPT computes, in bf16."""
    config = hf_config(as_spec(cfg))
    from transformers import LlamaConfig

    if not isinstance(config, LlamaConfig):
        raise ValueError(f"a {type(config).__name__} model is not a Llama")
    return config
