"""The embedded default model's shape: a small Llama-shaped GPT, described without megatron-core.

`megatron_build.build_gpt` turns it into a Megatron-core model; `convert.hf_llama_config` into
the matching Hugging Face Llama.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TinyGPTConfig:
    """A Llama-shaped GPT: RMSNorm, SwiGLU, RoPE, GQA, no linear bias, untied output layer."""

    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 128
    vocab_size: int = 128
    seq_len: int = 32
    num_experts: int = 0  # 0: dense; > 0: the last layer is MoE, with expert_bias
    moe_router_topk: int = 1
    fp32_param: bool = False  # one fp32-dtype param (its DDP buffer is its own)
    frozen_param: bool = False  # decoder.layers.0.input_layernorm.weight gets requires_grad=False
    rotary_base: int = 10000
    seed: int = 1234
    lr: float = 1e-3
    clip_grad: float = 1.0
