"""The HF-config reader against transformers itself: the planner's count of a config is the
parameter count of the model transformers builds from it.

- The converter's own configs (`hf_config(spec)` for llama, qwen3, qwen3_moe), read back from
  `to_dict()`: the family and shape come back, and the tiny model transformers builds has exactly
  the planner's count (a vocabulary of 256 needs no Megatron padding, and these have no MTP).
- Published shapes, made with transformers' own config classes (their defaults, or Qwen3-4B's
  values) and built on the meta device: the planner's `hf_params()` (no vocabulary padding, no
  MTP layer, which HF's models do not build) equals the HF model's numel less the parts the
  reader names as not counted (vision towers and their projectors), to the parameter.
- The tie defaults in orchestrator/models/hf_types.py are the config classes' own.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
import transformers

from orchestrator.adapters.megatron.convert import Family, hf_config
from orchestrator.models import ModelShape, read_config
from orchestrator.models.hf_types import HF_TYPES
from orchestrator.plan.model import from_config, hf_params, total_params

TINY: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    num_layers=3,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    ffn_hidden_size=128,
    max_position_embeddings=32,
    rotary_base=500000.0,
)
CONVERTER_SPECS = {
    Family.LLAMA: ModelShape(family=Family.LLAMA, **TINY),
    Family.QWEN3: ModelShape(family=Family.QWEN3, qk_layernorm=True, **TINY),
    Family.QWEN3_MOE: ModelShape(
        family=Family.QWEN3_MOE,
        qk_layernorm=True,
        num_experts=4,
        moe_ffn_hidden_size=32,
        moe_router_topk=2,
        moe_norm_topk_prob=True,
        moe_layers=(1, 2),
        **TINY,
    ),
}


def numel(model: torch.nn.Module, leave_out: tuple[str, ...] = ()) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if not any(part in n for part in leave_out))


@pytest.mark.parametrize("family", list(CONVERTER_SPECS), ids=str)
def test_the_converters_config_reads_back_and_counts_as_transformers_builds_it(family: Family) -> None:
    spec = CONVERTER_SPECS[family]
    config = hf_config(spec)
    arch = read_config(config.to_dict(), source=f"hf_config({family})")
    assert arch.family is family
    assert (arch.hidden_size, arch.num_layers, arch.num_attention_heads, arch.num_query_groups, arch.head_dim) == (
        64,
        3,
        4,
        2,
        16,
    )
    assert arch.qk_layernorm == spec.qk_layernorm and not arch.tie_embeddings and arch.rotary_base == 500000.0
    assert arch.moe_layers == spec.moe_layers
    assert (arch.num_experts, arch.moe_ffn_hidden_size) == (spec.num_experts, spec.moe_ffn_hidden_size)
    if spec.num_experts:
        assert (arch.moe_router_topk, arch.moe_norm_topk_prob) == (2, True)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert total_params(from_config(config.to_dict(), source=family)) == numel(model)


VISION = ("visual", "vision_tower", "vision_model", "multi_modal_projector")
QWEN3_4B: dict[str, Any] = dict(
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
)
PUBLISHED: dict[str, tuple[Callable[[], Any], Any]] = {
    "qwen3-4b": (lambda: transformers.Qwen3Config(**QWEN3_4B), transformers.Qwen3ForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
    "glm_moe_dsa": (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM),
    "qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration),
    "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
    "gemma3": (transformers.Gemma3Config, transformers.Gemma3ForConditionalGeneration),
    "llama4": (transformers.Llama4Config, transformers.Llama4ForConditionalGeneration),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_shapes_count_as_transformers_builds_them(name: str) -> None:
    make_config, model_class = PUBLISHED[name]
    config = make_config()
    saved = json.loads(config.to_json_string(use_diff=True))  # what save_pretrained writes
    spec = from_config(saved, source=name)
    with torch.device("meta"):
        model = model_class(config)
    vision = numel(model) - numel(model, VISION)
    assert hf_params(spec) == numel(model) - vision
    assert bool(spec.not_counted) == (vision > 0)


def test_gemma3_without_a_tie_key_ties_as_transformers_does() -> None:
    saved = json.loads(transformers.Gemma3Config().to_json_string(use_diff=True))
    del saved["tie_word_embeddings"]
    config = transformers.Gemma3Config(**{k: v for k, v in saved.items() if k != "transformers_version"})
    with torch.device("meta"):
        model = transformers.Gemma3ForConditionalGeneration(config)
    assert config.tie_word_embeddings and from_config(saved, source="gemma3").tie_embeddings
    assert hf_params(from_config(saved, source="gemma3")) == numel(model, VISION)


@pytest.mark.parametrize("facts", HF_TYPES, ids=lambda f: f.model_type)
def test_the_type_table_is_transformers_own(facts: Any) -> None:
    config_class = transformers.CONFIG_MAPPING[facts.model_type]
    config = config_class()
    assert getattr(config, "tie_word_embeddings", False) == facts.tie
    if facts.text_type:
        assert config_class.sub_configs["text_config"].model_type == facts.text_type
    for name in facts.classes:
        assert getattr(transformers, name).config_class is config_class
