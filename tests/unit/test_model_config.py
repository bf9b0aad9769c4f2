"""The one HF-config reader (orchestrator.models.read_config): what each config style says, what a
model type says for it, and every bad value named at once. Counts by hand; the counts against the
models transformers builds are in tests/integration/test_hf_config_reader.py."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.errors import ConfigError
from orchestrator.models import Family, read_config
from orchestrator.plan.model import from_config, total_params
from orchestrator.plan.presets import QWEN3_4B
from tests.support.hf_configs import LLAMA4_TEXT, MIXTRAL, QWEN3_VL

QWEN3_4B_PARAMS = 4_022_468_096


def attention(h: int, heads: int, groups: int, d: int) -> int:
    return h * (heads + 2 * groups) * d + heads * d * h


def test_qwen3_vl_keeps_its_top_level_tie_and_its_q_k_norms_and_names_the_vision_tower() -> None:
    arch = read_config(QWEN3_VL, source="qwen3-vl")
    assert arch.tie_embeddings and arch.qk_layernorm and not arch.qkv_bias
    assert (arch.model_type, arch.text_model_type, arch.family) == ("qwen3_vl", "qwen3_vl_text", None)
    assert arch.not_counted == ("the vision encoder (vision_config) and what joins it to the text model",)
    assert arch.name == "Qwen3VLForConditionalGeneration"
    assert total_params(from_config(QWEN3_VL, source="qwen3-vl")) == QWEN3_4B_PARAMS


def test_qwen2_5_vl_biases_q_k_v_as_its_model_type_does() -> None:
    config = {
        "model_type": "qwen2_5_vl",
        "text_config": {k: v for k, v in QWEN3_4B.items() if k not in ("architectures", "model_type")},
    }
    arch = read_config(config, source="qwen2.5-vl")
    assert arch.text_model_type == "qwen2_5_vl_text"  # from the wrapper's type
    assert arch.qkv_bias and not arch.out_bias and not arch.qk_layernorm
    spec = from_config(config, source="qwen2.5-vl")
    assert total_params(spec) == QWEN3_4B_PARAMS - 36 * 2 * 128 + 36 * (32 + 2 * 8) * 128  # no q/k norm; biases


def test_a_missing_tie_key_takes_the_model_types_default() -> None:
    gemma = {**{k: v for k, v in QWEN3_4B.items() if k not in ("tie_word_embeddings",)}, "model_type": "gemma3_text"}
    assert read_config(gemma, source="gemma").tie_embeddings  # Gemma3TextConfig ties by default
    assert read_config({**gemma, "tie_word_embeddings": False}, source="gemma").tie_embeddings is False
    llama = {**gemma, "model_type": "llama"}
    assert read_config(llama, source="llama").tie_embeddings is False
    unknown = read_config({**gemma, "model_type": "somebody_new"}, source="new")
    assert not unknown.tie_embeddings and "counted untied" in unknown.assumed[0]


def test_mixtral_names_its_experts_num_local_experts_and_its_expert_ffn_intermediate_size() -> None:
    arch = read_config(MIXTRAL, source="mixtral")
    assert (arch.num_experts, arch.moe_ffn_hidden_size, arch.ffn_hidden_size) == (4, 96, 0)
    assert arch.moe_layers == (0, 1) and arch.family is Family.MIXTRAL and arch.moe_norm_topk_prob
    h = 64
    layer = 2 * h + attention(h, 4, 2, 16) + 4 * h + 4 * 3 * h * 96  # norms, attention, router, experts
    assert total_params(from_config(MIXTRAL, source="mixtral")) == 2 * 256 * h + 2 * layer + h


def test_llama4_interleaves_dense_and_moe_layers_with_a_shared_expert_and_no_qk_norm_weights() -> None:
    arch = read_config(LLAMA4_TEXT, source="llama4")
    assert arch.moe_layers == (1, 3)
    assert (arch.ffn_hidden_size, arch.moe_ffn_hidden_size, arch.moe_shared_ffn_hidden_size) == (128, 32, 32)
    assert arch.qk_l2_norm and not arch.qk_layernorm and arch.moe_score_function == "sigmoid"
    h, att = 64, attention(64, 4, 2, 16)
    dense = 2 * h + att + 3 * h * 128
    moe = 2 * h + att + 4 * h + 4 * 3 * h * 32 + 3 * h * 32
    assert total_params(from_config(LLAMA4_TEXT, source="llama4")) == 2 * 256 * h + 2 * dense + 2 * moe + h
    resolved = read_config({**LLAMA4_TEXT, "moe_layers": [0, 3]}, source="llama4")  # transformers' resolved list
    assert resolved.moe_layers == (0, 3)


def test_the_name_comes_from_the_config() -> None:
    assert read_config({**QWEN3_4B, "_name_or_path": "Qwen/Qwen3-4B"}, source="x").name == "Qwen/Qwen3-4B"
    assert read_config(QWEN3_4B, source="x").name == "Qwen3ForCausalLM"
    no_class = {k: v for k, v in QWEN3_4B.items() if k != "architectures"}
    assert read_config({**no_class, "model_type": "qwen3"}, source="x").name == "qwen3"


def test_rope_moe_routing_and_mtp_are_read() -> None:
    config: dict[str, Any] = {
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_nextn_predict_layers": 1,
        "n_routed_experts": 8,
        "n_shared_experts": 2,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "num_attention_heads": 4,
        "q_lora_rank": 16,
        "kv_lora_rank": 8,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "vocab_size": 256,
        "rope_scaling": {"type": "yarn", "factor": 40, "rope_theta": 10000},
    }
    a = read_config(config, source="dsv3")
    assert a.moe_layers == (1, 2) and a.moe_shared_ffn_hidden_size == 32 and a.mtp_num_layers == 1
    assert (a.moe_score_function, a.expert_bias, a.moe_router_num_groups, a.moe_router_group_topk) == (
        "sigmoid",
        True,
        4,
        2,
    )
    assert (a.moe_routed_scaling_factor, a.moe_norm_topk_prob) == (2.5, True)
    assert (a.rope_scaling, a.rope_factor, a.rotary_base) == ("yarn", 40.0, 10000.0)
    assert a.mla and a.head_dim == 0 and a.qk_head_dim == 12


BAD: list[tuple[dict[str, Any], list[str]]] = [
    ({"hidden_size": "2560"}, ["hidden_size must be an integer, got '2560'"]),
    ({"hidden_size": None}, ["hidden_size is null, not an integer"]),
    ({"intermediate_size": -1}, ["intermediate_size must be >= 0, got -1"]),
    ({"head_dim": -128}, ["head_dim must be >= 1, got -128"]),
    ({"kv_lora_rank": -512}, ["kv_lora_rank must be >= 0, got -512"]),
    ({"num_key_value_heads": 0}, ["num_key_value_heads must be >= 1, got 0"]),
    ({"num_key_value_heads": 5}, ["num_attention_heads (32) must be a multiple of num_key_value_heads (5)"]),
    ({"tie_word_embeddings": "yes"}, ["tie_word_embeddings must be true or false"]),
    ({"intermediate_size": 0}, ["intermediate_size must be > 0 for the 36 dense layers"]),
    ({"rope_theta": "big"}, ["rope_theta must be a non-negative number, got 'big'"]),
    ({"architectures": "Qwen3ForCausalLM"}, ["architectures must be a list of class names"]),
]


@pytest.mark.parametrize(
    ("change", "says"), BAD, ids=[next(iter(c)) + "=" + str(next(iter(c.values()))) for c, _ in BAD]
)
def test_a_bad_value_is_named(change: dict[str, Any], says: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        read_config({**QWEN3_4B, **change}, source="cfg.json")
    for words in says:
        assert f"cfg.json: {words}" in str(caught.value)


def test_every_problem_is_named_at_once() -> None:
    bad = {**QWEN3_4B, "hidden_size": None, "vocab_size": "lots", "head_dim": -1, "intermediate_size": -5}
    with pytest.raises(ConfigError) as caught:
        read_config(bad, source="cfg.json")
    assert len(caught.value.violations) == 4, caught.value


def test_moe_layer_lists_are_checked() -> None:
    moe = {**MIXTRAL, "model_type": "qwen3_moe", "moe_intermediate_size": 16, "num_hidden_layers": 4}
    with pytest.raises(ConfigError, match="mlp_only_layers must be a list of layer indices, got 5"):
        read_config({**moe, "mlp_only_layers": 5}, source="c")
    with pytest.raises(ConfigError, match=r"mlp_only_layers names layers \[7\] outside the model's 4"):
        read_config({**moe, "mlp_only_layers": [1, 7]}, source="c")
    assert read_config({**moe, "mlp_only_layers": [1]}, source="c").moe_layers == (0, 2, 3)
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(9\) must be in 1..4"):
        read_config({**MIXTRAL, "num_experts_per_tok": 9}, source="c")
    with pytest.raises(ConfigError, match="not a JSON object"):
        read_config([1, 2], source="c")  # type: ignore[arg-type]
