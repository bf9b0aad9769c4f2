"""The planner counts what each rank holds, by hand-checked arithmetic, and refuses bad input."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.plan.memory import GradDtype, OptimizerSpec, Parallelism, buffer_numel, plan
from orchestrator.plan.model import (
    Kind,
    Tensor,
    active_params,
    from_hf_config,
    padded_vocab,
    stage_tensors,
    total_params,
)
from orchestrator.plan.presets import GLM5, QWEN3_4B, load_model
from states import Mode
from tests.support.cli import run
from tests.support.hf_configs import SMALL_MLA


def write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_qwen3_4b_counts_the_published_4_02_b_params() -> None:
    h, ffn, hd, vocab, layers = 2560, 9728, 128, 151936, 36
    layer = 2 * h + h * (32 + 2 * 8) * hd + 32 * hd * h + 2 * hd + 3 * h * ffn  # norms, qkv, o, q/k norm, MLP
    by_hand = vocab * h + layers * layer + h  # tied embedding, final norm
    assert total_params(load_model("qwen3-4b")) == by_hand == 4_022_468_096


def test_mla_moe_mtp_by_hand(tmp_path: Path) -> None:
    m = from_hf_config(write(tmp_path, SMALL_MLA))
    h, heads = 64, 4
    attention = (
        h  # input norm
        + 16 * h + 16 + 16 * heads * 12  # q down, q norm, q up (nope 8 + rope 4)
        + (8 + 4) * h + 8 + 8 * heads * (8 + 8)  # kv down (+ rope key), kv norm, kv up (nope + v)
        + heads * 8 * h  # out proj
    )  # fmt: skip
    dense = h + 3 * h * 96
    moe = h + 4 * h + 4 * 3 * h * 16 + 3 * h * 16  # norm, router, 4 experts, 1 shared
    mtp = 2 * h + 2 * h * h + attention + moe + h  # enorm, hnorm, eh_proj, layer, its norm
    by_hand = 2 * 256 * h + 3 * attention + dense + 2 * moe + h + mtp  # untied embeddings
    assert total_params(m) == by_hand
    assert active_params(m) == by_hand - 3 * (4 - 2) * 3 * h * 16  # 2 of 4 experts, 3 MoE layers
    assert m.expert_bias and m.moe_layers == (1, 2)


def test_tp_shards_linears_and_replicates_norms_routers_and_mla_down_projections(tmp_path: Path) -> None:
    m = from_hf_config(write(tmp_path, SMALL_MLA))
    whole = plan(m, Parallelism()).ranks[0]
    split = plan(m, Parallelism(tp=2, dp=2, ep=2, etp=1)).ranks[0]
    etp_is_tp = plan(m, Parallelism(tp=2, dp=2, ep=2)).ranks[0]  # Megatron's default ETP: TP
    h = 64
    replicated_per_attention = h + 16 * h + 16 + 12 * h + 8  # input norm, q down + norm, kv down + norm
    experts = 3 * 4 * 3 * h * 16  # 3 MoE layers (MTP's too) x 4 experts
    norms_routers = 4 * h + 4 * h * 3 + 2 * h + h + h  # 4 pre-MLP norms, 3 routers, enorm/hnorm, 2 final norms
    replicated = 4 * replicated_per_attention + norms_routers
    sharded = whole.params - replicated - experts
    assert split.params == replicated + sharded // 2 + experts // 2
    assert etp_is_tp.params == replicated + sharded // 2 + experts // 4


def test_glm5_is_744_b_without_its_mtp_layer_and_lands_the_backup_per_stage() -> None:
    m = load_model("glm-5")
    without_mtp = replace(m, mtp_num_layers=0)
    assert 742e9 < total_params(without_mtp) < 746e9
    p = plan(m, Parallelism(tp=8, pp=4, ep=16, etp=1, dp=2, pp_layers=(19, 20, 20, 19)), gpus_per_node=4)
    assert [r.layers for r in p.ranks] == [19, 20, 20, 19]
    # bf16 backup is 2 bytes a param held (padding aside); extras are expert_bias only
    for r in p.ranks:
        assert r.backup == r.param_buffer + r.extras
        assert 0 <= r.param_buffer - 2 * r.params < 2 * 64 * 2000  # at most 64 elements of padding a tensor
        assert r.extras == 4 * 256 * len(set(m.moe_layers) & set(p.parallel.stages(m)[r.stage])) + (
            4 * 256 if r.stage == 3 else 0
        )
    assert p.parallel.expert_dp == 1  # EP16 fills a stage's 16 ranks: expert state is not sharded


def test_buffers_pad_like_megatron() -> None:
    tensors = [Tensor("a", 100), Tensor("b", 10)]
    assert buffer_numel(tensors, dp=1, distributed=True) == 256  # 128 + 10 -> end on 128
    assert buffer_numel(tensors, dp=3, distributed=True) == 384  # lcm(3, 128)
    assert buffer_numel(tensors, dp=3, distributed=False) == 110
    assert padded_vocab(151936, 2) == 152064


def test_optimizer_settings_change_grads_mains_and_moments() -> None:
    m = load_model("qwen3-4b")
    fp32 = plan(m, Parallelism(dp=2)).ranks[0]
    bf16 = plan(m, Parallelism(dp=2), optimizer=OptimizerSpec(grad_dtype=GradDtype.BF16)).ranks[0]
    plain = plan(m, Parallelism(dp=2), optimizer=OptimizerSpec(distributed=False), mode=Mode.BACKUP).ranks[0]
    assert bf16.grad_buffer * 2 == fp32.grad_buffer
    assert plain.mains == 2 * fp32.mains and plain.adam == 2 * fp32.adam
    assert plan(m, Parallelism(), optimizer=OptimizerSpec(adam=False)).ranks[0].adam == 0


def test_extras_are_what_rematerialize_pins_and_backup_pins_everything() -> None:
    p = plan(load_model("gpu-1b"), Parallelism())
    (r,) = p.ranks
    assert r.extras == 4 * 2 + 4 * 2048 + 2 * 2048  # expert_bias of 2 experts, an fp32 param, a frozen norm
    assert r.backup == r.param_buffer + r.extras
    assert p.host_pinned(r) == r.extras
    assert replace(p, mode=Mode.BACKUP).host_pinned(r) == r.backup


@pytest.mark.parametrize(
    ("parallel", "words"),
    [
        (Parallelism(tp=3), "attention heads (32) do not divide by TP (3)"),
        (Parallelism(pp=5), "36 layers do not divide by PP (5)"),
        (Parallelism(pp=2, pp_layers=(10, 20)), "must give 2 stages summing to the model's 36 layers"),
        (Parallelism(dp=0), "dp must be >= 1"),
    ],
)
def test_bad_parallelism_names_the_problem(parallel: Parallelism, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        plan(load_model("qwen3-4b"), parallel)
    assert words in str(caught.value)


def test_experts_must_divide_by_ep() -> None:
    with pytest.raises(ConfigError, match=r"routed experts \(256\) do not divide by EP \(3\)"):
        plan(load_model("glm-5"), Parallelism(tp=3, ep=3, pp_layers=()))


def test_hf_config_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_model(tmp_path / "missing.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable JSON config"):
        load_model(tmp_path)
    bad.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ConfigError, match="missing 'num_hidden_layers'"):
        load_model(bad)


def test_presets_match_their_config_dicts(tmp_path: Path) -> None:
    for name, config in (("qwen3-4b", QWEN3_4B), ("glm-5", GLM5)):
        from_file = from_hf_config(write(tmp_path, config))
        assert total_params(from_file) == total_params(load_model(name))


def test_extras_are_marked_by_kind() -> None:
    m = load_model("cpu")
    tensors = stage_tensors(m, range(m.num_layers), first=True, last=True, tp=1, ep=1, etp=1)
    kinds = {t.name: t.kind for t in tensors if t.kind is not Kind.PARAM}
    assert kinds == {
        "decoder.layers.0.input_layernorm.weight": Kind.FROZEN,
        "decoder.layers.3.mlp.router.expert_bias": Kind.EXPERT_BIAS,
        "fp32_params": Kind.FP32,
    }
    assert all(t.expert == (".experts." in t.name) for t in tensors)


@pytest.mark.slow
def test_cli_prints_json_and_refuses_bad_input_with_exit_2(tmp_path: Path) -> None:
    done = run("plan", "qwen3-4b", "--tp", "2", "--dp", "2", "--json")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    want = plan(load_model("qwen3-4b"), Parallelism(tp=2, dp=2)).ranks[0]
    assert got["stages"][0]["param_buffer"] == want.param_buffer
    assert got["stages"][0]["phases"]["rollout"]["device"] > 0
    bad = run("plan", "qwen3-4b", "--tp", "3")
    assert bad.returncode == 2 and "attention heads (32) do not divide by TP (3)" in bad.stderr
    missing = run("plan", str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
    table = run(
        "plan", "glm-5", "--tp", "8", "--pp", "4", "--ep", "16", "--etp", "1", "--dp", "2", "--pp-layers", "19,20,20,19"
    )
    assert table.returncode == 0 and "pinned backup" in table.stdout
