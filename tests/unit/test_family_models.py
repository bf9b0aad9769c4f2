"""`job.models`: the seed's workloads from their published configs, shrunk with every feature kept,
and every bad input refused by name (what `colocate run --model/--layers/--experts` takes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.job.models import describe, family_model, shrink
from orchestrator.job.presets import grpo_config
from orchestrator.models import Family
from orchestrator.plan.presets import published_config


def test_qwen3_4b_whole_is_the_published_model_tied_and_q_k_normed() -> None:
    model = family_model("qwen3-4b")
    shape = model.model
    assert (shape.family, shape.num_layers, shape.hidden_size) == (Family.QWEN3, 36, 2560)
    assert shape.tie_embeddings and shape.qk_layernorm
    assert model.shrunk == ()
    assert model.served == published_config("qwen3-4b")


def test_glm5_shrunk_keeps_its_widths_and_every_feature() -> None:
    model = family_model("glm-5", layers=3, experts=16)
    shape = model.model
    assert (shape.family, shape.num_layers, shape.num_experts) == (Family.GLM_MOE_DSA, 3, 16)
    assert (shape.hidden_size, shape.kv_lora_rank, shape.q_lora_rank) == (6144, 512, 2048)
    assert shape.moe_layers == (1, 2)  # one dense layer first, MoE in the rest
    assert shape.dsa_index_n_heads == 32 and shape.expert_bias and shape.moe_shared_ffn_hidden_size
    assert shape.mtp_num_layers == 1  # GLM-5's MTP layer is built (and trained)
    assert shape.layernorm_epsilon == 1e-6
    assert model.shrunk == (
        "3 of 78 layers, 1 dense and 2 MoE",
        "16 of 256 experts",
        "rms_norm_eps 1e-05 → 1e-06: Megatron has one eps, and HF's MLA latent norms use 1e-06",
    )
    assert "glm-5 (glm_moe_dsa, GlmMoeDsaForCausalLM); 3 of 78 layers" in describe(model)


def test_deepseek_v3_shrunk_keeps_its_groups_and_loses_its_fp8_scales_and_mtp() -> None:
    model = family_model("deepseek-v3", layers=3, experts=16)
    shape = model.model
    assert (shape.moe_router_num_groups, shape.moe_router_group_topk, shape.moe_router_topk) == (8, 4, 8)
    assert shape.yarn_original_max_position_embeddings == 4096 and shape.mtp_num_layers == 0
    assert "quantization_config" not in model.served and "auto_map" not in model.served
    assert "1 MTP layer(s) left out: colocate converts GLM-5's only" in model.shrunk


def test_per_layer_lists_follow_the_layers_kept() -> None:
    config = {**published_config("glm-5"), "indexer_types": ["full"] * 78}
    config["mlp_layer_types"] = ["dense"] * 3 + ["sparse"] * 75
    served, _ = shrink(config, layers=4)
    assert served["mlp_layer_types"] == ["dense", "sparse", "sparse", "sparse"]
    assert served["indexer_types"] == ["full"] * 4 and served["first_k_dense_replace"] == 1


@pytest.mark.parametrize(
    ("name", "layers", "experts", "message"),
    [
        ("glm-5", 0, None, "--layers must be in 1..78 (the model's num_hidden_layers), got 0"),
        ("glm-5", 79, None, "--layers must be in 1..78"),
        ("glm-5", None, 4, "--experts must be in 8..256 (num_experts_per_tok..n_routed_experts), got 4"),
        ("deepseek-v3", None, 12, "it must split into n_group=8 equal groups"),
        ("deepseek-v3", None, 8, "of which topk_group=4 hold at least num_experts_per_tok=8"),
        ("qwen3-4b", None, 8, "--experts is for a model with routed experts; this one has none"),
    ],
)
def test_a_shrink_the_model_cannot_take_is_refused_by_name(
    name: str, layers: int | None, experts: int | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        family_model(name, layers=layers, experts=experts)


def test_a_config_of_no_family_or_no_file_or_no_json_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model_type 'gemma2' is no family colocate converts"):
        family_model({"model_type": "gemma2", "hidden_size": 8, "num_hidden_layers": 1, "vocab_size": 8,
                      "num_attention_heads": 1, "intermediate_size": 8})  # fmt: skip
    with pytest.raises(ConfigError, match=r"no such config\.json, and not a built-in model"):
        family_model(tmp_path / "missing.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read it as JSON"):
        family_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="not a JSON object"):
        family_model(tmp_path)


def test_a_preset_is_not_shrunk_and_an_unknown_name_names_every_choice() -> None:
    with pytest.raises(ConfigError, match="--layers and --experts shrink a family model; preset tiny is fixed"):
        grpo_config("tiny", layers=1)
    with pytest.raises(ConfigError, match=r"not a preset \(tiny, qwen-0.5b, llama-1b\) or a seed workload"):
        grpo_config("gpt-5")
    grpo = grpo_config("qwen3-4b", layers=1)
    assert grpo.task.vocab_size == 151936 == grpo.model.vocab_size  # the task in the whole vocabulary
