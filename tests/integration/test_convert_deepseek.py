"""DeepSeek-V3 and GLM-4.5 conversion rules, checked against Megatron-core's and transformers'
own code without a rank: names against what `save_pretrained` writes, the tensors MLA maps as
they are, GLM-4.5's q/k/v bias split, the specs Megatron's configs read as, the refusals, and the
math both sides must compute the same (the sigmoid router with bias and groups; YaRN's frequencies,
cos/sin scale and softmax scale; MLA's interleaved RoPE). The models themselves are built, trained,
synced through `colocate_megatron` and compared at TP, PP and EP in test_families.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from orchestrator.adapters.megatron.convert import Family, family_of, hf_config, hf_names, to_hf
from orchestrator.adapters.megatron.convert.spec import checked, shape_from_megatron
from orchestrator.models import ModelShape
from tests.support.megatron_parallel import parallel_config

DEEPSEEK = checked(
    ModelShape(
        family=Family.DEEPSEEK_V3,
        vocab_size=128,
        hidden_size=64,
        num_layers=3,
        num_attention_heads=4,
        num_query_groups=4,
        head_dim=16,
        ffn_hidden_size=128,
        max_position_embeddings=16,
        rotary_base=10000.0,
        layernorm_epsilon=1e-6,
        qk_layernorm=True,
        num_experts=8,
        moe_ffn_hidden_size=32,
        moe_router_topk=2,
        moe_layers=(1, 2),
        expert_bias=True,
        q_lora_rank=32,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        rope_scaling="yarn",
        rope_factor=4.0,
        yarn_original_max_position_embeddings=4,
        yarn_mscale_all_dim=0.8,
        moe_score_function="sigmoid",
        moe_shared_ffn_hidden_size=64,
        moe_router_num_groups=2,
        moe_router_group_topk=1,
        moe_routed_scaling_factor=2.5,
    )
)
DEEPSEEK_Q = checked(
    ModelShape(**{**asdict(DEEPSEEK), "q_lora_rank": 0, "rope_scaling": "", "rope_factor": 1.0, "moe_layers": (1, 2)})
)
GLM = checked(
    ModelShape(
        **{
            **asdict(DEEPSEEK),
            "family": Family.GLM4_MOE,
            "num_query_groups": 2,
            "rotary_base": 500000.0,
            "layernorm_epsilon": 1e-5,
            "moe_layers": (1, 2),
            "q_lora_rank": 0,
            "kv_lora_rank": 0,
            "qk_nope_head_dim": 0,
            "qk_rope_head_dim": 0,
            "v_head_dim": 0,
            "rope_scaling": "",
            "rope_factor": 1.0,
            "yarn_mscale_all_dim": 0.0,
            "qkv_bias": True,
            "rotary_percent": 0.5,
        }
    )
)
GLM_PLAIN = checked(ModelShape(**{**asdict(GLM), "moe_layers": (1, 2), "qkv_bias": False, "qk_layernorm": False}))
SPECS = {"deepseek_v3": DEEPSEEK, "deepseek_v3 q_proj": DEEPSEEK_Q, "glm4_moe": GLM, "glm4_moe plain": GLM_PLAIN}


@pytest.mark.parametrize("spec", list(SPECS.values()), ids=list(SPECS))
def test_hf_names_are_what_transformers_saves(spec: ModelShape, tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(hf_config(spec)).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as saved:
        assert sorted(saved.keys()) == sorted(hf_names(spec))


MLA_NAMES = {  # Megatron (local spec, then TE spec's fused norms) → HF, under layer 2
    "linear_q_down_proj.weight": "q_a_proj.weight",
    "q_layernorm.weight": "q_a_layernorm.weight",
    "linear_q_up_proj.layer_norm_weight": "q_a_layernorm.weight",
    "linear_q_up_proj.weight": "q_b_proj.weight",
    "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
    "kv_layernorm.weight": "kv_a_layernorm.weight",
    "linear_kv_up_proj.layer_norm_weight": "kv_a_layernorm.weight",
    "linear_kv_up_proj.weight": "kv_b_proj.weight",
    "linear_proj.weight": "o_proj.weight",
}


@pytest.mark.parametrize(("megatron", "hf"), list(MLA_NAMES.items()))
def test_mla_tensors_map_as_they_are(megatron: str, hf: str, tmp_path: Path) -> None:
    """Megatron's MLA and HF's hold the same matrices in the same row layouts (see `mla`)."""
    from transformers import AutoModelForCausalLM

    hf_name = f"model.layers.2.self_attn.{hf}"
    shape = AutoModelForCausalLM.from_config(hf_config(DEEPSEEK)).state_dict()[hf_name].shape
    tensor = torch.randn(shape)
    ((name, out),) = to_hf(f"decoder.layers.2.self_attention.{megatron}", tensor, DEEPSEEK)
    assert name == hf_name and out is tensor


def test_without_a_q_latent_q_is_projected_directly() -> None:
    ((name, _),) = to_hf("decoder.layers.0.self_attention.linear_q_proj.weight", torch.zeros(96, 64), DEEPSEEK_Q)
    assert name == "model.layers.0.self_attn.q_proj.weight"


def test_glm_qkv_bias_is_split_per_query_group() -> None:
    """Element r of linear_qkv.bias holds r: each group is [2 q heads, 1 k head, 1 v head] of 16."""
    parts = to_hf("decoder.layers.1.self_attention.linear_qkv.bias", torch.arange(128.0), GLM)
    assert [name for name, _ in parts] == [f"model.layers.1.self_attn.{p}_proj.bias" for p in "qkv"]
    (_, q), (_, k), (_, v) = parts
    assert q.tolist() == [*range(0, 32), *range(64, 96)]
    assert k.tolist() == [*range(32, 48), *range(96, 112)]
    assert v.tolist() == [*range(48, 64), *range(112, 128)]


@pytest.mark.parametrize("spec", [DEEPSEEK, GLM], ids=lambda s: s.family.value)
def test_router_bias_and_shared_experts_map_to_the_moe_layer(spec: ModelShape) -> None:
    bias = torch.arange(8.0)
    ((name, out),) = to_hf("decoder.layers.2.mlp.router.expert_bias", bias, spec)
    assert name == "model.layers.2.mlp.gate.e_score_correction_bias" and out is bias
    fc1 = torch.arange(128.0)[:, None].expand(-1, 64)
    (gate_name, gate), (up_name, up) = to_hf("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", fc1, spec)
    assert (gate_name, up_name) == (
        "model.layers.1.mlp.shared_experts.gate_proj.weight",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
    )
    assert gate[:, 0].tolist() == list(range(64)) and up[0, 0] == 64
    ((down, _),) = to_hf("decoder.layers.1.mlp.shared_experts.linear_fc2.weight", torch.zeros(64, 64), spec)
    assert down == "model.layers.1.mlp.shared_experts.down_proj.weight"


# ---- what Megatron's configs read as ----------------------------------------------------------------


def _gpt(config: Any, rotary_percent: float = 1.0) -> SimpleNamespace:
    """What the spec reads of a `GPTModel`, with Megatron's own RoPE where the GPT has one."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(
        config.kv_channels, rotary_percent=rotary_percent, rotary_base=500000, use_cpu_initialization=True
    )
    return SimpleNamespace(
        vocab_size=128,
        max_sequence_length=16,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        rotary_pos_emb=None if config.multi_latent_attention else rope,
        rotary_base=500000,
        rotary_percent=rotary_percent,
    )


def test_megatrons_deepseek_config_reads_as_deepseek_v3() -> None:
    config = parallel_config(Family.DEEPSEEK_V3, 1, 1, 1)
    assert family_of(config) is Family.DEEPSEEK_V3
    hf = hf_config(shape_from_megatron(config, _gpt(config)))
    assert (hf.q_lora_rank, hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim) == (
        32,
        32,
        16,
        8,
        12,
    )
    assert (hf.head_dim, hf.num_key_value_heads, hf.rope_interleave, hf.rms_norm_eps) == (8, 4, True, 1e-6)
    assert hf.rope_parameters == {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 4,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    }
    _assert_routed(hf)


def test_megatrons_glm_config_reads_as_glm4_moe() -> None:
    config = parallel_config(Family.GLM4_MOE, 1, 1, 1)
    assert family_of(config) is Family.GLM4_MOE
    hf = hf_config(shape_from_megatron(config, _gpt(config, rotary_percent=0.5)))
    assert (hf.attention_bias, hf.use_qk_norm, hf.head_dim, hf.num_key_value_heads) == (True, True, 24, 2)
    assert hf.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5}
    _assert_routed(hf)


def _assert_routed(hf: Any) -> None:
    assert (hf.n_routed_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.n_shared_experts) == (8, 2, 32, 2)
    assert (hf.n_group, hf.topk_group, hf.routed_scaling_factor, hf.norm_topk_prob) == (2, 1, 2.5, True)
    assert (hf.first_k_dense_replace, hf.num_nextn_predict_layers, hf.tie_word_embeddings) == (1, 0, False)


@pytest.mark.parametrize(
    ("family", "change", "why"),
    [
        (Family.DEEPSEEK_V3, {"moe_router_topk": 4}, "ranks groups by their top topk // group_topk"),
        (Family.DEEPSEEK_V3, {"moe_shared_expert_intermediate_size": 48}, "shared experts of ffn 48"),
        (Family.DEEPSEEK_V3, {"moe_shared_expert_gate": True}, "moe_shared_expert_gate"),
        (Family.DEEPSEEK_V3, {"moe_router_enable_expert_bias": False}, "e_score_correction_bias"),
        (Family.DEEPSEEK_V3, {"moe_layer_freq": [1, 0]}, r"MoE layers \[0\]"),
        (Family.DEEPSEEK_V3, {"layernorm_epsilon": 1e-5}, "q_a/kv_a norms use 1e-06"),
        (Family.DEEPSEEK_V3, {"qk_layernorm": False}, "no qk_layernorm"),
        (Family.DEEPSEEK_V3, {"mscale": 0.7, "mscale_all_dim": 0.0}, "YaRN mscale without mscale_all_dim"),
        (Family.DEEPSEEK_V3, {"rope_type": "rope"}, "rope_type='rope' with mscale_all_dim"),
        (Family.DEEPSEEK_V3, {"mtp_num_layers": 1}, "MTP layers are not converted"),
        (
            Family.GLM4_MOE,
            {"moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False},
            "routes by sigmoid",
        ),
        (Family.GLM4_MOE, {"moe_router_num_groups": 8}, "8 experts in 8 groups"),
        (Family.QWEN3_MOE, {"moe_router_topk_scaling_factor": 2.0}, "scaling_factor .HF qwen3_moe has no counterpart"),
        (Family.QWEN3_MOE, {"moe_shared_expert_intermediate_size": 64}, "shared experts .HF qwen3_moe"),
    ],
)
def test_what_the_family_cannot_compute_is_refused(family: Family, change: dict[str, Any], why: str) -> None:
    import dataclasses

    config = dataclasses.replace(parallel_config(family, 1, 1, 1), **change)
    with pytest.raises(ValueError, match=f"no HF {family.value} equivalent: .*{why}"):
        shape_from_megatron(config, _gpt(config), family)


@pytest.mark.parametrize(
    ("family", "change", "why"),
    [
        (
            Family.GLM4_MOE,
            {"kv_lora_rank": 24, "qk_rope_head_dim": 8},
            "multi_latent_attention .HF glm4_moe has no counterpart",
        ),
        (Family.DEEPSEEK_V3, {"kv_lora_rank": 0}, "HF deepseek_v3's attention is MLA"),
        (Family.LLAMA, {"qkv_bias": True, "num_experts": 0, "moe_layers": ()}, "add_qkv_bias .HF llama"),
        (Family.QWEN3, {"rotary_percent": 0.5, "num_experts": 0, "moe_layers": ()}, "rotary_percent=0.5 .HF qwen3"),
        (Family.GLM4_MOE, {"rotary_percent": 0.3}, "not an even width"),
    ],
)
def test_a_spec_the_family_cannot_compute_is_refused(family: Family, change: dict[str, Any], why: str) -> None:
    base = DEEPSEEK if family is Family.DEEPSEEK_V3 else GLM
    with pytest.raises(ValueError, match=f"no HF {family.value} equivalent: .*{why}"):
        checked(ModelShape(**{**asdict(base), **change, "family": family}))


# ---- the math both sides compute ---------------------------------------------------------------------


ROUTINGS = {  # experts, top-k, groups, groups chosen, scale
    "DeepSeek-V3's groups": (256, 8, 8, 4, 2.5),
    "the parallel test's": (8, 2, 2, 1, 2.5),
    "no groups": (8, 2, 0, 0, 1.0),
    "top-1": (8, 1, 0, 0, 1.0),
}


def _route(experts: int, topk: int, groups: int, group_topk: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing weights [tokens, experts] Megatron's sigmoid routing gives random tokens, and
    HF's router (built from the converter's config for the spec) for the same weights and bias."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    keys = dict(num_experts=experts, moe_router_topk=topk, moe_router_num_groups=groups)
    keys |= dict(moe_router_group_topk=group_topk, moe_routed_scaling_factor=scale, moe_norm_topk_prob=topk > 1)
    hf_router = DeepseekV3TopkRouter(
        hf_config(checked(ModelShape(**{**asdict(DEEPSEEK), **keys, "moe_layers": (1, 2)})))
    )
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(512, 64, generator=generator)
    with torch.no_grad():
        hf_router.weight.copy_(torch.randn(experts, 64, generator=generator) * 0.125)
        hf_router.e_score_correction_bias.copy_(torch.randn(experts, generator=generator) * 0.1)
        _, weights, chosen = hf_router(hidden)
        megatron, _ = topk_routing_with_score_function(
            hidden @ hf_router.weight.T,
            topk,
            num_groups=groups or None,
            group_topk=group_topk or None,
            scaling_factor=scale if scale != 1.0 else None,
            score_function="sigmoid",
            expert_bias=hf_router.e_score_correction_bias,
        )
    return megatron, torch.zeros(512, experts).scatter(1, chosen, weights)


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_megatrons_sigmoid_router_chooses_and_weighs_as_hfs(routing: str) -> None:
    megatron, hf = _route(*ROUTINGS[routing])
    assert torch.equal(megatron > 0, hf > 0), "the same experts for every token"
    torch.testing.assert_close(megatron, hf)


def test_groups_ranked_by_more_than_two_scores_route_otherwise_in_hf() -> None:
    """Why the spec refuses top-k // group top-k != 2: Megatron ranks each group by its top 4 here,
    HF by its top 2 (the spec with these settings is refused, so the HF side is built by hand)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    scores = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
    megatron, _ = topk_routing_with_score_function(scores, 4, num_groups=2, group_topk=1, score_function="sigmoid")
    sigmoid = scores.sigmoid().view(512, 2, 4)
    best_by_top2 = sigmoid.topk(2, dim=-1)[0].sum(-1).argmax(-1)  # HF's group choice
    assert (megatron.view(512, 2, 4).sum(-1).argmax(-1) != best_by_top2).any()
    with pytest.raises(ValueError, match="ranks groups by their top topk // group_topk"):
        checked(ModelShape(**{**asdict(DEEPSEEK), "moe_router_topk": 4, "moe_layers": (1, 2)}))


YARNS = {  # rope dims, factor, original positions, mscale, mscale_all_dim
    "the parallel test's": (8, 4.0, 4, 1.0, 0.8),
    "DeepSeek-V3's": (64, 40.0, 4096, 1.0, 1.0),
    "both mscales": (64, 40.0, 4096, 1.2, 0.8),
}


@pytest.mark.parametrize("yarn", list(YARNS))
def test_megatrons_yarn_is_hfs(yarn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Frequencies, the cos/sin scale and MLA's softmax scale. Megatron's YaRN moves its
    frequencies to `torch.cuda.current_device()`; for this test that is the CPU."""
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as megatron_yarn
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    dim, factor, original, mscale, mscale_all_dim = YARNS[yarn]
    rope = megatron_yarn.YarnRotaryEmbedding(
        dim,
        use_cpu_initialization=True,
        scaling_factor=factor,
        original_max_position_embeddings=original,
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
    )
    emb, megatron_mscale = rope.get_emb(64)  # [positions, 1, 1, dim]
    keys = dict(qk_rope_head_dim=dim, rope_factor=factor, yarn_original_max_position_embeddings=original)
    keys |= dict(yarn_mscale=mscale, yarn_mscale_all_dim=mscale_all_dim, max_position_embeddings=int(factor * original))
    config = hf_config(checked(ModelShape(**{**asdict(DEEPSEEK), **keys, "moe_layers": (1, 2)})))
    cos, sin = DeepseekV3RotaryEmbedding(config)(torch.zeros(1), torch.arange(64)[None])
    torch.testing.assert_close(cos[0], emb[:, 0, 0].cos() * megatron_mscale)  # as `apply_rotary_pos_emb` scales them
    torch.testing.assert_close(sin[0], emb[:, 0, 0].sin() * megatron_mscale)
    # MultiLatentAttention.__init__: softmax_scale = mscale² / sqrt(q head dim), mscale from mscale_all_dim.
    softmax_scale = megatron_yarn._yarn_get_mscale(factor, mscale_all_dim) ** 2 / math.sqrt(16 + dim)
    assert DeepseekV3Attention(config, 0).scaling == pytest.approx(softmax_scale, rel=1e-12)


def test_mla_rotates_interleaved_pairs_as_hfs_rope_interleave() -> None:
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    generator = torch.Generator().manual_seed(0)
    rope_dims = torch.randn(16, 2, 4, 8, generator=generator)  # [seq, batch, heads, dim], Megatron's order
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
    angles = torch.outer(torch.arange(16.0), inv_freq).repeat(1, 2)  # [seq, dim]: cat(freqs, freqs)
    megatron = _apply_rotary_pos_emb_bshd(rope_dims, angles[:, None, None], multi_latent_attention=True)
    q = rope_dims.permute(1, 2, 0, 3)  # HF's [batch, heads, seq, dim]
    interleaved, _ = hf.apply_rotary_pos_emb_interleave(q, q, angles.cos()[None], angles.sin()[None])
    torch.testing.assert_close(interleaved, megatron.permute(1, 2, 0, 3))
    halves, _ = hf.apply_rotary_pos_emb(q, q, angles.cos()[None], angles.sin()[None])
    assert not torch.allclose(halves, interleaved, atol=0.1), "rope_interleave=False rotates other pairs"
