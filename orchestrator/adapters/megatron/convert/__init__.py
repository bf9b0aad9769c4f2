"""Megatron-core GPT → Hugging Face weights: names, layouts, and the gathers TP, PP and EP need.

- `hf_buckets(model_chunks, bucket_bytes=...)`: the trainer-side entry point, run on every rank;
  yields this stage's HF tensors in buckets (`gather`). `conversion_problems` says beforehand,
  with no collective, why it would refuse a model, `left_out` what it leaves out on purpose (the
  MTP layers, unless `mtp=True`).
- `to_hf` / `convert`: whole Megatron tensors → HF checkpoint tensors (`hf`).
- `shape_from_megatron`: the `ModelShape` (orchestrator.models) of a Megatron `TransformerConfig`
  and `GPTModel`; a `TinyGPTConfig`'s is `cfg.shape()`. `checked` refuses a shape its HF family
  would compute otherwise (`spec`); `hf_config(shape)` is the transformers config. `ModelSpec` is
  the old name of a checked shape (`ModelSpec.from_megatron`), kept for code written against it.

Families: Llama, Qwen3 (q/k norm), Qwen3-MoE (router, experts), Mixtral (every layer MoE, no q/k
norm), DeepSeek-V3 (MLA and YaRN in `mla`; sigmoid-routed experts with a selection bias, groups,
a scale and shared experts in `routed`), GLM-4.5 (q/k/v biases, partial rotary in `glm`;
`routed`'s experts), GLM-5 (DeepSeek-V3's layers with the DSA indexer of `dsa`; its MTP layers
in `mtp`, sent with `mtp=True`); tied embeddings; GroupedMLP experts.
"""

from orchestrator.adapters.megatron.convert.gather import (
    conversion_problems,
    hf_buckets,
    is_sync_source,
    left_out,
    model_spec,
)
from orchestrator.adapters.megatron.convert.hf import (
    ATTN_IMPLEMENTATION,
    MEGATRON_LAYERNORM_EPS,
    convert,
    hf_config,
    hf_llama_config,
    hf_names,
    hf_shape,
    hf_targets,
    to_hf,
)
from orchestrator.adapters.megatron.convert.spec import Family, ModelSpec, checked, family_of, shape_from_megatron
from orchestrator.models import ModelShape

__all__ = [
    "ATTN_IMPLEMENTATION",
    "MEGATRON_LAYERNORM_EPS",
    "Family",
    "ModelShape",
    "ModelSpec",
    "checked",
    "conversion_problems",
    "convert",
    "family_of",
    "hf_buckets",
    "hf_config",
    "hf_llama_config",
    "hf_names",
    "hf_shape",
    "hf_targets",
    "is_sync_source",
    "left_out",
    "model_spec",
    "shape_from_megatron",
    "to_hf",
]
