"""What an HF `model_type` fixes that its config.json need not say.

A config.json names only what differs from its class's defaults (`to_diff_dict`), and some
parts are in the modeling code, not the config: Qwen2 always biases q/k/v, Qwen3 always
normalises q and k, Gemma-3 always ties its embeddings unless told otherwise. One row per type,
read from transformers 5's `models/<type>/configuration_<type>.py` (the field defaults) and
`modeling_<type>.py` (the modules); tests/integration/test_hf_config_reader.py checks the tie
defaults against the config classes and every count against the models transformers builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["HF_TYPES", "Bias", "QKNorm", "TypeFacts", "facts_for", "type_of_class"]


class Bias(StrEnum):
    """Where a type's attention biases come from."""

    KEY = "key"  # the type's bias key (`attention_bias`, or Qwen2-MoE's `qkv_bias`) turns them on
    QKV = "qkv"  # always on q/k/v, never on o (Qwen2's `bias=True`)
    NONE = "none"  # never (Mistral, Mixtral: `bias=False`)


class QKNorm(StrEnum):
    """A type's per-head norm on q and k."""

    NONE = "none"
    RMS = "rms"  # always, with a learned weight per head dim (Qwen3, Gemma-3)
    RMS_IF_KEY = "rms_if_key"  # learned, when `use_qk_norm` says so (GLM-4.5)
    L2_IF_KEY = "l2_if_key"  # parameter-free L2 norm, when `use_qk_norm` says so (Llama-4)


@dataclass(frozen=True)
class TypeFacts:
    """One `model_type`: its defaults, and what its modeling code fixes."""

    model_type: str
    classes: tuple[str, ...] = ()  # the `architectures` entries that name it
    tie: bool = False  # the config class's `tie_word_embeddings` default
    bias: Bias = Bias.KEY
    bias_key: str = "attention_bias"
    bias_default: bool = False
    o_bias: bool = True  # the bias key covers o_proj too (Llama's; GLM's o_proj has none)
    qk_norm: QKNorm = QKNorm.NONE
    qk_norm_default: bool = False  # `use_qk_norm`'s default, where the key decides
    sandwich_norms: bool = False  # Gemma's extra norms after attention and around the MLP
    shared_experts: int = 0  # shared experts the modeling code always adds, of the expert size
    shared_expert_gate: bool = False  # Qwen2-MoE's sigmoid gate on its shared expert
    router_score: str = "softmax"  # the router's score function, where no `scoring_func` key says
    expert_bias: bool = False  # e_score_correction_bias on the sigmoid scores (DeepSeek-V3's noaux_tc)
    norm_topk_prob: bool = True  # `norm_topk_prob`'s default (Mixtral has no key and always does)
    norm_eps: float = 1e-6  # the config class's `rms_norm_eps` default
    rope_interleave: bool = False  # `rope_interleave`'s default (MLA's rotate interleaved pairs)
    text_type: str = ""  # a multimodal wrapper: its text config's model_type
    lm_head_in_text: bool = False  # the wrapper's LM head is the text sub-model's (tie from text_config)


HF_TYPES: tuple[TypeFacts, ...] = (
    TypeFacts("llama", ("LlamaForCausalLM",)),
    TypeFacts("mistral", ("MistralForCausalLM",), bias=Bias.NONE),
    TypeFacts("mixtral", ("MixtralForCausalLM",), bias=Bias.NONE, norm_eps=1e-5),
    TypeFacts("qwen2", ("Qwen2ForCausalLM",), bias=Bias.QKV),
    TypeFacts(
        "qwen2_moe",
        ("Qwen2MoeForCausalLM",),
        bias_key="qkv_bias",
        bias_default=True,
        o_bias=False,
        shared_expert_gate=True,
        norm_topk_prob=False,
    ),
    TypeFacts("qwen3", ("Qwen3ForCausalLM",), qk_norm=QKNorm.RMS),
    TypeFacts("qwen3_moe", ("Qwen3MoeForCausalLM",), qk_norm=QKNorm.RMS, norm_topk_prob=False),
    TypeFacts(
        "deepseek_v3", ("DeepseekV3ForCausalLM",), router_score="sigmoid", expert_bias=True, rope_interleave=True
    ),
    TypeFacts(
        "glm4_moe",
        ("Glm4MoeForCausalLM",),
        o_bias=False,
        qk_norm=QKNorm.RMS_IF_KEY,
        router_score="sigmoid",
        expert_bias=True,
        norm_eps=1e-5,
    ),
    TypeFacts(
        "glm_moe_dsa",
        ("GlmMoeDsaForCausalLM",),
        router_score="sigmoid",
        expert_bias=True,
        norm_eps=1e-5,
        rope_interleave=True,
    ),
    TypeFacts("gemma2", ("Gemma2ForCausalLM",), tie=True, sandwich_norms=True),
    TypeFacts("gemma3_text", ("Gemma3ForCausalLM",), tie=True, qk_norm=QKNorm.RMS, sandwich_norms=True),
    TypeFacts("gemma3", ("Gemma3ForConditionalGeneration",), tie=True, text_type="gemma3_text"),
    TypeFacts(
        "llama4_text",
        ("Llama4ForCausalLM",),
        qk_norm=QKNorm.L2_IF_KEY,
        qk_norm_default=True,
        shared_experts=1,
        router_score="sigmoid",
        norm_eps=1e-5,
    ),
    TypeFacts("llama4", ("Llama4ForConditionalGeneration",), text_type="llama4_text", lm_head_in_text=True),
    TypeFacts("qwen2_vl_text", bias=Bias.QKV),
    TypeFacts("qwen2_vl", ("Qwen2VLForConditionalGeneration",), text_type="qwen2_vl_text"),
    TypeFacts("qwen2_5_vl_text", bias=Bias.QKV),
    TypeFacts("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",), text_type="qwen2_5_vl_text"),
    TypeFacts("qwen3_vl_text", qk_norm=QKNorm.RMS),
    TypeFacts("qwen3_vl", ("Qwen3VLForConditionalGeneration",), text_type="qwen3_vl_text"),
    TypeFacts("qwen3_vl_moe_text", tie=True, qk_norm=QKNorm.RMS),
    TypeFacts("qwen3_vl_moe", ("Qwen3VLMoeForConditionalGeneration",), text_type="qwen3_vl_moe_text"),
)

_BY_TYPE = {f.model_type: f for f in HF_TYPES}
_BY_CLASS = {c: f.model_type for f in HF_TYPES for c in f.classes}


def facts_for(model_type: str) -> TypeFacts | None:
    return _BY_TYPE.get(model_type)


def type_of_class(architectures: tuple[str, ...]) -> str:
    """The model_type the first known class in `architectures` belongs to ("" if none)."""
    return next((_BY_CLASS[a] for a in architectures if a in _BY_CLASS), "")
