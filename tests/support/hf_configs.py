"""HF config.json objects the planner and reader tests share: small models of each style, and a
multimodal one nesting Qwen3-4B's text model."""

from __future__ import annotations

from orchestrator.plan.presets import QWEN3_4B

# A small DeepSeek-style model: MLA, 1 dense + 2 MoE layers, a shared expert, one MTP layer.
SMALL_MLA = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 1,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "num_attention_heads": 4,
    "q_lora_rank": 16,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "vocab_size": 256,
    "topk_method": "noaux_tc",
}

# Qwen3-4B's text model, as a Qwen3-VL config nests it (transformers 5 layout): no architectures
# or tie key inside text_config; those are at the top level.
QWEN3_VL = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_vl_text",
        **{k: v for k, v in QWEN3_4B.items() if k not in ("architectures", "model_type", "tie_word_embeddings")},
    },
    "vision_config": {"model_type": "qwen3_vl", "depth": 24, "hidden_size": 1024},
}

MIXTRAL = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 64,
    "intermediate_size": 96,  # Mixtral's expert FFN
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 256,
}

# Llama-4's text model: dense and MoE layers interleaved, one shared expert, L2 q/k norm.
LLAMA4_TEXT = {
    "model_type": "llama4_text",
    "hidden_size": 64,
    "intermediate_size": 32,  # the experts'
    "intermediate_size_mlp": 128,  # the dense layers'
    "num_hidden_layers": 4,
    "interleave_moe_layer_step": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 1,
    "vocab_size": 256,
}
