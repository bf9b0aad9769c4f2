"""Megatron-core GPT → HF, the rules for tied embeddings, Mixtral and GroupedMLP experts (fast; the
parallel syncs into transformers' own classes are in `test_families`).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from orchestrator.adapters.megatron.convert import Family, hf_config, hf_names, hf_targets, to_hf
from orchestrator.adapters.megatron.convert.spec import checked
from orchestrator.models import ModelShape

BASE: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    ffn_hidden_size=128,
    max_position_embeddings=32,
    rotary_base=500000.0,
)
MOE: dict[str, Any] = dict(num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2)
MIXTRAL = checked(ModelShape(family=Family.MIXTRAL, moe_layers=(0, 1), **MOE, **BASE))
QWEN3_MOE = checked(ModelShape(family=Family.QWEN3_MOE, qk_layernorm=True, moe_layers=(1,), **MOE, **BASE))
QWEN3_TIED = checked(ModelShape(family=Family.QWEN3, qk_layernorm=True, tie_embeddings=True, **BASE))
LLAMA_TIED = checked(ModelShape(family=Family.LLAMA, tie_embeddings=True, **BASE))


@pytest.mark.parametrize(
    "spec",
    [QWEN3_TIED, LLAMA_TIED, MIXTRAL, checked(ModelShape(**{**asdict(MIXTRAL), "tie_embeddings": True}))],
    ids=["qwen3 tied", "llama tied", "mixtral", "mixtral tied"],
)
def test_hf_names_are_what_transformers_saves(spec: ModelShape, tmp_path: Path) -> None:
    """Tied: no `lm_head.weight` (transformers writes the embedding alone); Mixtral: its own
    checkpoint names (transformers un-fuses its experts into exactly these)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config(spec))
    assert model.config.tie_word_embeddings is spec.tie_embeddings
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as saved:
        assert sorted(saved.keys()) == sorted(hf_names(spec))


# ---- tied embeddings --------------------------------------------------------------------------


def test_the_output_layer_of_tied_embeddings_is_not_sent() -> None:
    """At PP > 1 the last stage holds a copy of the embedding as `output_layer.weight`."""
    assert to_hf("output_layer.weight", torch.zeros(128, 64), QWEN3_TIED) == []
    assert hf_targets("output_layer.weight", QWEN3_TIED) == []
    assert "lm_head.weight" not in hf_names(QWEN3_TIED)
    with pytest.raises(ValueError, match=r"'output_layer.weight'.*shape \(64, 64\)"):
        to_hf("output_layer.weight", torch.zeros(64, 64), QWEN3_TIED)


# ---- Mixtral --------------------------------------------------------------------------------


def test_mixtral_config_is_mixtrals() -> None:
    config = hf_config(MIXTRAL)
    assert type(config).__name__ == "MixtralConfig"
    assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == (4, 2, 32)
    assert config.sliding_window is None and config.router_jitter_noise == 0.0
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}


def test_router_and_experts_map_to_mixtrals() -> None:
    fc1 = torch.arange(64, dtype=torch.float32)[:, None].expand(-1, 64)
    (w1, gate), (w3, up) = to_hf("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight", fc1, MIXTRAL)
    assert (w1, w3) == (
        "model.layers.0.block_sparse_moe.experts.3.w1.weight",
        "model.layers.0.block_sparse_moe.experts.3.w3.weight",
    )
    assert gate[:, 0].tolist() == list(range(32)) and up[0, 0] == 32, "w1 is the gate, w3 the up projection"
    ((router, _),) = to_hf("decoder.layers.1.mlp.router.weight", torch.zeros(4, 64), MIXTRAL)
    assert router == "model.layers.1.block_sparse_moe.gate.weight"
    ((w2, _),) = to_hf("decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight", torch.zeros(64, 32), MIXTRAL)
    assert w2 == "model.layers.1.block_sparse_moe.experts.0.w2.weight"


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"moe_layers": (1,)}, r"dense layers \[0\] .every Mixtral layer is MoE"),
        ({"qk_layernorm": True}, "qk_layernorm .Mixtral has no q/k norm"),
        ({"expert_bias": True}, "Mixtral's router has no expert bias"),
        ({"moe_norm_topk_prob": False}, "moe_router_pre_softmax=True .Mixtral renormalises"),
        ({"num_experts": 0, "moe_layers": ()}, "no MoE layer"),
    ],
)
def test_a_model_mixtral_cannot_compute_is_refused(change: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=f"no HF mixtral equivalent: .*{why}"):
        checked(ModelShape(**{**asdict(MIXTRAL), **change}))


def test_a_dense_family_with_experts_names_the_moe_family_to_use() -> None:
    with pytest.raises(ValueError, match="the llama family is dense: use mixtral"):
        checked(ModelShape(**{**asdict(MIXTRAL), "family": Family.LLAMA}))


@pytest.mark.parametrize(
    ("name", "spec", "why"),
    [
        ("decoder.layers.1.mlp.router.expert_bias", MIXTRAL, "Mixtral's router has no expert bias"),
        ("decoder.layers.1.mlp.experts.linear_fc1.weight0", MIXTRAL, "TEGroupedMLP"),
        ("decoder.layers.1.mlp.experts.linear_fc2.weight3", QWEN3_MOE, "TEGroupedMLP"),
        ("decoder.layers.1.mlp.experts.weight1", QWEN3_TIED, "no counterpart in a dense model"),
        ("decoder.layers.0.mlp.experts.weight2", QWEN3_MOE, "layer 0 is a dense layer"),
    ],
)
def test_unconvertible_expert_tensors_are_refused_by_name(name: str, spec: ModelShape, why: str) -> None:
    """`to_hf` refuses them alike (it goes through the same rules), as does `hf_buckets` before any gather."""
    with pytest.raises(ValueError, match=f"{name!r}.*{why}"):
        hf_targets(name, spec)


# ---- GroupedMLP ------------------------------------------------------------------------------


def _grouped_forward(weight1: torch.Tensor, weight2: torch.Tensor, x: torch.Tensor, expert: int) -> torch.Tensor:
    """What `GroupedMLP.forward` computes for one expert's tokens (megatron-core 0.16.1, gated
    SiLU): `gmm(x, weight1.view(experts, hidden, -1))`, glu, `gmm(., weight2.view(experts, -1, hidden))`."""
    experts, hidden = MOE["num_experts"], BASE["hidden_size"]
    gate, up = (x @ weight1.view(experts, hidden, -1)[expert]).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ weight2.view(experts, -1, hidden)[expert]


@pytest.mark.parametrize("spec", [QWEN3_MOE, MIXTRAL], ids=["qwen3_moe", "mixtral"])
def test_grouped_experts_convert_to_what_hf_computes(spec: ModelShape) -> None:
    """A whole GroupedMLP weight1 [hidden, experts · 2 · ffn] and weight2 [experts · ffn, hidden]
    become each expert's HF projections, and HF's expert computes GroupedMLP's function."""
    generator = torch.Generator().manual_seed(0)
    hidden, experts, ffn = 64, 4, 32
    weight1 = torch.randn(hidden, experts * 2 * ffn, generator=generator, dtype=torch.float64)
    weight2 = torch.randn(experts * ffn, hidden, generator=generator, dtype=torch.float64)
    x = torch.randn(5, hidden, generator=generator, dtype=torch.float64)
    hf = dict(to_hf("decoder.layers.1.mlp.experts.weight1", weight1, spec))
    hf |= dict(to_hf("decoder.layers.1.mlp.experts.weight2", weight2, spec))
    assert sorted(hf) == sorted(n for n in hf_names(spec) if ".layers.1." in n and ".experts." in n)
    assert hf_targets("decoder.layers.1.mlp.experts.weight1", spec) == [
        n for n, t in hf.items() if t.shape == (ffn, hidden)
    ]
    names = ("w1", "w3", "w2") if spec.family is Family.MIXTRAL else ("gate_proj", "up_proj", "down_proj")
    prefix = "model.layers.1.block_sparse_moe" if spec.family is Family.MIXTRAL else "model.layers.1.mlp"
    for e in range(experts):
        gate, up, down = (hf[f"{prefix}.experts.{e}.{n}.weight"] for n in names)
        expected = _grouped_forward(weight1, weight2, x, e)
        torch.testing.assert_close(F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down), expected)


def test_a_grouped_weight_of_another_shape_or_place_is_refused() -> None:
    with pytest.raises(ValueError, match="layer 0 is a dense layer"):
        to_hf("decoder.layers.0.mlp.experts.weight2", torch.zeros(128, 64), QWEN3_MOE)
    with pytest.raises(
        ValueError, match=r"shape \(32, 256\) is not 4 experts' GroupedMLP linear_fc1 of hidden size 64"
    ):
        to_hf("decoder.layers.1.mlp.experts.weight1", torch.zeros(32, 256), MIXTRAL)
    with pytest.raises(ValueError, match=r"linear_fc2.weight'.*shape \(64, 16\)"):
        to_hf("decoder.layers.1.mlp.experts.weight2", torch.zeros(64, 64), MIXTRAL)  # ffn 16, not 32
