"""Models the planner knows by name: colocate's own test and benchmark GPTs, and published ones.

The published configs are written out here from their model cards' `config.json` values, so
planning never downloads anything.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from orchestrator.adapters.megatron.gpt import TinyGPTConfig
from orchestrator.errors import ConfigError
from orchestrator.job.presets import benchmark_model, preset
from orchestrator.plan.model import ModelSpec, from_config, from_hf_config

# colocate's own GPTs: the job's default, and the restore benchmark's models (orchestrator/job/presets.py);
# `gpu-1b` is the benchmark's `llama-1b`, extras included.
# Built on demand: the job's default lives with GRPOConfig, which imports torch; planning never does.
TINY_GPTS: dict[str, Callable[[], TinyGPTConfig]] = {
    "tiny": lambda: preset("tiny"),
    "cpu": lambda: benchmark_model("cpu"),
    "gpu-1b": lambda: benchmark_model("llama-1b"),
}


def from_tiny_gpt(cfg: TinyGPTConfig, name: str = "tiny-gpt") -> ModelSpec:
    """The ModelSpec of `megatron_build.build_gpt(cfg)`: its last layer is MoE when it has experts."""
    moe = cfg.num_experts > 0
    return ModelSpec(
        name=name,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        vocab_size=cfg.vocab_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        moe_layers=(False,) * (cfg.num_layers - 1) + (moe,),
        num_experts=cfg.num_experts,
        moe_ffn_hidden_size=cfg.ffn_hidden_size if moe else 0,
        moe_router_topk=cfg.moe_router_topk,
        expert_bias=moe,
        fp32_param_numel=cfg.hidden_size if cfg.fp32_param else 0,
        frozen=("decoder.layers.0.input_layernorm.weight",) if cfg.frozen_param else (),
    )


# Qwen/Qwen3-4B's config.json (the values that size it).
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "attention_bias": False,
    "tie_word_embeddings": True,
}

# GLM-5 as the issue states its published architecture: MLA (q LoRA 2048, kv LoRA 512, qk head
# 192 = 128 nope + 64 RoPE, v head 256, 64 heads), 3 dense + 75 MoE layers and 1 MTP layer,
# 256 routed experts (8 active) + 1 shared, a sigmoid router with expert_bias; and, as a DSA
# model, a sparse-attention indexer per layer (32 heads of 128).
GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "first_k_dense_replace": 3,
    "num_nextn_predict_layers": 1,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "index_n_heads": 32,  # DeepSeek sparse attention's indexer
    "index_head_dim": 128,
    "vocab_size": 154880,
    "topk_method": "noaux_tc",
    "tie_word_embeddings": False,
}


def _tiny(name: str) -> Callable[[], ModelSpec]:
    return lambda: from_tiny_gpt(TINY_GPTS[name](), name)


PRESETS: dict[str, Callable[[], ModelSpec]] = {
    **{name: _tiny(name) for name in TINY_GPTS},
    "qwen3-4b": lambda: from_config(QWEN3_4B, source="preset qwen3-4b", name="qwen3-4b"),
    "glm-5": lambda: from_config(GLM5, source="preset glm-5", name="glm-5"),
}


def load_model(source: str | Path) -> ModelSpec:
    """A preset's name, or the path of an HF `config.json` (or of the folder that holds one)."""
    if isinstance(source, str) and source in PRESETS:
        return PRESETS[source]()
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ConfigError([f"model {source!r}: no such file, and not a preset (presets: {', '.join(sorted(PRESETS))})"])
    return from_hf_config(path)
