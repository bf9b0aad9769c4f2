"""GLM-5 (glm_moe_dsa) conversion rules beyond DeepSeek-V3's: the DSA indexer and the MTP layer.

Without a rank: names and shapes against what transformers' `save_pretrained` writes, the MTP
layer against DeepSeek-V3's checkpoint layout, the indexer's row reorder, what Megatron's config
reads as, the refusals, and the Hadamard seam against the Sylvester matrix. The whole model is
built, trained, synced through `colocate_megatron` and compared at TP, PP and EP in
test_families.py, and each stage's first indexer there against transformers' on the same inputs.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from orchestrator.adapters.megatron.convert import Family, family_of, hf_config, hf_names, hf_shape, to_hf
from orchestrator.adapters.megatron.convert.mtp import left_out
from orchestrator.adapters.megatron.convert.spec import checked, shape_from_megatron
from orchestrator.models import ModelShape
from tests.integration.test_convert_deepseek import DEEPSEEK
from tests.support.megatron_dsa import walsh_hadamard
from tests.support.megatron_parallel import parallel_config

# DeepSeek-V3's tiny shape without YaRN, groups or a routed scale, with the indexer and one MTP layer.
GLM5 = checked(
    ModelShape(
        **{
            **asdict(DEEPSEEK),
            "family": Family.GLM_MOE_DSA,
            "moe_layers": (1, 2),
            "rope_scaling": "",
            "rope_factor": 1.0,
            "yarn_original_max_position_embeddings": 0,
            "yarn_mscale_all_dim": 0.0,
            "moe_router_num_groups": 0,
            "moe_router_group_topk": 0,
            "moe_routed_scaling_factor": 1.0,
            "dsa_index_n_heads": 4,
            "dsa_index_head_dim": 32,
            "dsa_index_topk": 4,
            "mtp_num_layers": 1,
        }
    )
)


def _saved(spec: ModelShape, tmp: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(hf_config(spec)).save_pretrained(tmp)
    with safe_open(str(tmp / "model.safetensors"), "pt") as saved:
        return {name: tuple(saved.get_slice(name).get_shape()) for name in saved.keys()}  # noqa: SIM118


def test_names_and_shapes_are_what_transformers_saves(tmp_path: Path) -> None:
    saved = _saved(GLM5, tmp_path)
    assert saved == {name: hf_shape(name, GLM5) for name in hf_names(GLM5)}


def test_the_mtp_layer_is_deepseek_v3s_layer_after_the_last(tmp_path: Path) -> None:
    """DeepSeek-V3's checkpoint (README_WEIGHTS.md) keeps MTP module j as layer N + j: enorm, hnorm,
    eh_proj, shared_head.norm and a decoder layer like the main model's, plus embed_tokens and
    shared_head.head, which share the main model's embedding and head and are not sent."""
    n = GLM5.num_layers
    last = {
        name.split(".", 3)[3]: shape for name, shape in _saved(GLM5, tmp_path).items() if f"layers.{n - 1}." in name
    }
    glue = {"enorm.weight": (64,), "hnorm.weight": (64,), "eh_proj.weight": (64, 128), "shared_head.norm.weight": (64,)}
    deepseek_layer = {f"model.layers.{n}.{name}": shape for name, shape in {**last, **glue}.items()}
    shared = {f"model.layers.{n}.embed_tokens.weight", f"model.layers.{n}.shared_head.head.weight"}
    mtp = sorted(set(hf_names(GLM5, mtp=True)) - set(hf_names(GLM5)))
    assert {name: hf_shape(name, GLM5) for name in mtp} == deepseek_layer
    assert not shared & set(mtp)
    assert hf_config(GLM5).num_nextn_predict_layers == 1


def test_mtp_tensors_map_to_layer_n() -> None:
    hidden = torch.randn(64)
    ((name, out),) = to_hf("decoder.layers.3.final_layernorm.weight", hidden, GLM5)
    assert name == "model.layers.3.shared_head.norm.weight" and out is hidden
    ((name, _),) = to_hf("decoder.layers.3.eh_proj.weight", torch.zeros(64, 128), GLM5)
    assert name == "model.layers.3.eh_proj.weight"
    ((name, _),) = to_hf("decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.weight", torch.zeros(64, 32), GLM5)
    assert name == "model.layers.3.mlp.experts.7.down_proj.weight"  # the last layer's kind: MoE
    with pytest.raises(ValueError, match="decoder layer, not an MTP layer"):
        to_hf("decoder.layers.2.enorm.weight", hidden, GLM5)
    with pytest.raises(ValueError, match="beyond num_layers=3 and 1 MTP layer"):
        to_hf("decoder.layers.4.enorm.weight", hidden, GLM5)


def test_left_out_names_the_mtp_layers_unless_asked() -> None:
    names = ["decoder.final_layernorm.weight", "mtp.layers.0.enorm.weight", "mtp.layers.0.eh_proj.weight"]
    (note,) = left_out(names, mtp=False)
    assert note.startswith("MTP layer(s) mtp.layers.0 left out") and "mtp=True" in note
    assert left_out(names, mtp=True) == [] and left_out(names[:1], mtp=False) == []


def test_indexer_rows_move_the_rope_dims_first() -> None:
    """Row r holds r: per 32-row head, Megatron's [24 nope; 8 rope] become HF's [8 rope; 24 nope]."""
    per_head = [*range(24, 32), *range(24)]
    ((name, wq_b),) = to_hf(
        "decoder.layers.0.self_attention.core_attention.indexer.linear_wq_b.weight",
        torch.arange(128.0)[:, None].expand(-1, 32),
        GLM5,
    )
    assert name == "model.layers.0.self_attn.indexer.wq_b.weight"
    assert wq_b[:, 0].tolist() == [32 * h + r for h in range(4) for r in per_head]
    for megatron, hf in [
        ("linear_wk.weight", "wk.weight"),
        ("k_norm.weight", "k_norm.weight"),
        ("k_norm.bias", "k_norm.bias"),
    ]:
        shape = (32, 64) if megatron.startswith("linear") else (32,)
        rows = torch.arange(32.0).view(32, *([1] * (len(shape) - 1))).expand(shape)
        ((name, out),) = to_hf(f"decoder.layers.1.self_attention.core_attention.indexer.{megatron}", rows, GLM5)
        assert name == f"model.layers.1.self_attn.indexer.{hf}"
        assert out.reshape(32, -1)[:, 0].tolist() == per_head
    weights = torch.randn(4, 64)
    ((name, out),) = to_hf(
        "decoder.layers.2.self_attention.core_attention.indexer.linear_weights_proj.weight", weights, GLM5
    )
    assert name == "model.layers.2.self_attn.indexer.weights_proj.weight" and out is weights


def test_from_megatron_0_19_the_indexer_rows_map_as_they_are() -> None:
    """megatron-core 0.19 puts the rope dims first, as HF does (its configs have
    `dsa_indexer_rope_interleaved`, which `dsa.megatron_fields` reads as that layout)."""
    spec = checked(ModelShape(**{**asdict(GLM5), "dsa_index_rope_first": True}))
    rows = torch.randn(128, 32)
    ((_, out),) = to_hf("decoder.layers.0.self_attention.core_attention.indexer.linear_wq_b.weight", rows, spec)
    assert out is rows


_DSA_0_19 = dict(  # megatron-core 0.19's indexer options, as GLM-5 needs them
    dsa_indexer_rope_interleaved=True,
    dsa_indexer_scoring_relu=True,
    dsa_indexer_topk_freq=1,
    dsa_indexer_skip_topk_offset=0,
)


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({}, None),
        ({"dsa_indexer_rope_interleaved": False}, "dsa_indexer_rope_interleaved=False"),
        ({"dsa_indexer_scoring_relu": False}, "dsa_indexer_scoring_relu=False"),
        ({"dsa_indexer_topk_freq": 2}, "layers sharing a top-k are not converted"),
        ({"dsa_indexer_k_norm_epsilon": 1e-5}, "indexer k norm eps 1e-05"),
    ],
)
def test_megatron_0_19s_indexer_options_hf_cannot_follow_are_refused(
    options: dict[str, Any], problem: str | None
) -> None:
    from orchestrator.adapters.megatron.convert import dsa

    config = SimpleNamespace(
        experimental_attention_variant="dsa",
        multi_latent_attention=True,
        layernorm_epsilon=1e-6,
        **(_DSA_0_19 | options),
    )
    found = dsa.megatron_problems(config)
    assert found == [] if problem is None else (len(found) == 1 and problem in found[0]), found
    fields = dsa.megatron_fields(
        SimpleNamespace(**vars(config), dsa_indexer_n_heads=4, dsa_indexer_head_dim=32, dsa_indexer_topk=4)
    )
    assert fields["dsa_index_rope_first"]


def test_hf_config_runs_an_indexer_in_every_layer() -> None:
    hf = hf_config(GLM5)
    assert type(hf).__name__ == "GlmMoeDsaConfig"
    assert (hf.index_n_heads, hf.index_head_dim, hf.index_topk) == (4, 32, 4)
    assert hf.indexer_types == ["full"] * 3 and hf.mlp_layer_types == ["dense", "sparse", "sparse"]
    assert (hf.q_lora_rank, hf.qk_rope_head_dim, hf.head_dim, hf.rms_norm_eps) == (32, 8, 8, 1e-6)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"family": Family.DEEPSEEK_V3, "mtp_num_layers": 0}, "a DSA indexer (sparse attention) (HF deepseek_v3"),
        (
            {"family": Family.DEEPSEEK_V3, "dsa_index_n_heads": 0},
            "mtp_num_layers=1 (MTP layers are not converted for deepseek_v3",
        ),
        ({"dsa_index_n_heads": 0}, "no DSA indexer"),
        ({"q_lora_rank": 0}, "no q_lora_rank"),
        ({"dsa_index_head_dim": 8}, "index head dim 8 not above the rope dims 8"),
    ],
)
def test_what_hf_glm_moe_dsa_cannot_compute_is_refused(changes: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        checked(ModelShape(**{**asdict(GLM5), **changes}))


def test_megatrons_dsa_config_reads_as_glm_moe_dsa() -> None:
    config = parallel_config(Family.GLM_MOE_DSA, 1, 1, 1)
    assert family_of(config) is Family.GLM_MOE_DSA
    gpt = SimpleNamespace(
        vocab_size=128,
        max_sequence_length=16,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    spec = shape_from_megatron(config, gpt)
    assert (spec.dsa_index_n_heads, spec.dsa_index_head_dim, spec.dsa_index_topk, spec.mtp_num_layers) == (4, 32, 4, 1)


def test_walsh_hadamard_is_the_scaled_sylvester_transform() -> None:
    sylvester = torch.ones(1, 1)
    for _ in range(5):
        sylvester = torch.cat([torch.cat([sylvester, sylvester], 1), torch.cat([sylvester, -sylvester], 1)])
    n, u = 32, 2.0**-24  # fp32's unit roundoff
    x = torch.randn(3, 5, n, generator=torch.Generator().manual_seed(0))
    y = x.flip(0)
    # Both sides sum n terms +-x_i / 2 in fp32, in other orders: each sum is within (n - 1) u of
    # the sum of the terms' magnitudes (any order's rounding bound), so the two within twice that.
    assert ((walsh_hadamard(x, 0.5) - x @ sylvester.T * 0.5).abs() <= 2 * n * u * x.abs().sum(-1, keepdim=True) / 2).all()
    q, k = walsh_hadamard(x, n**-0.5), walsh_hadamard(y, n**-0.5)
    # Orthonormal: q.k is x.y. Each q_j is off by at most (n + 1) u |x|_1 / sqrt(n) (the sum and the
    # scale), each k_j likewise; the two dot products round within n u of their terms' magnitudes.
    e_q, e_k = ((n + 1) * u * t.abs().sum(-1) / n**0.5 for t in (x, y))
    bound = (
        e_q * k.abs().sum(-1) + e_k * q.abs().sum(-1) + n * e_q * e_k
        + n * u * ((q * k).abs().sum(-1) + (x * y).abs().sum(-1))
    )  # fmt: skip
    assert (((q * k).sum(-1) - (x * y).sum(-1)).abs() <= bound).all(), "orthonormal: q·k is kept"
    assert walsh_hadamard(x.bfloat16()).dtype is torch.bfloat16
    with pytest.raises(ValueError, match="power-of-2"):
        walsh_hadamard(torch.zeros(2, 24))


def test_what_the_sync_leaves_out_is_logged_once_a_process(caplog: pytest.LogCaptureFixture) -> None:
    """Every sync of a rank says the same: it is logged at the first, from whichever thread."""
    import threading

    from orchestrator.adapters.megatron.convert.gather import say_once

    note = f"MTP layer(s) mtp.layers.0 left out ({threading.get_ident()})"  # new to this process
    with caplog.at_level("WARNING", logger="orchestrator.adapters.megatron.convert.gather"):
        threads = [threading.Thread(target=say_once, args=([note, note],)) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        say_once([note])
    assert [r.getMessage() for r in caplog.records].count(note) == 1
