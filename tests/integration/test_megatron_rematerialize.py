"""Rematerialize and backup restores on real megatron-core DDP + DistributedOptimizer (gloo, CPU).

The model has the awkward params: an MoE layer with an expert_bias buffer, an fp32 param and a
frozen param. World sizes 1 and 2 run in spawned processes (tests/support/megatron_ranks.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from tests.support.megatron_ranks import run_ranks

pytestmark = pytest.mark.slow

MODES = ("rematerialize", "backup")


@pytest.fixture(scope="module", params=[(1, 1), (2, 1), (2, 2)], ids=["ws1", "ws2", "ws2-ep2"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    world_size, ep = request.param
    return run_ranks("cycles", world_size, tmp_path_factory.mktemp(f"ws{world_size}ep{ep}"), ep=ep)


@pytest.mark.parametrize("mode", MODES)
def test_three_cycles_restore_bit_identical(ranks: list[dict], mode: str) -> None:
    for rank in ranks:
        cycles = rank[mode]
        assert len(cycles) == 3
        assert [c["bit_identical"] for c in cycles] == [True] * 3, [c["reason"] for c in cycles]


@pytest.mark.parametrize("mode", MODES)
def test_the_drop_really_lost_the_params(ranks: list[dict], mode: str) -> None:
    """Otherwise a bit-identical restore would prove nothing."""
    for rank in ranks:
        for cycle in rank[mode]:
            assert "decoder.layers.0.self_attention.linear_qkv.weight" in cycle["changed_by_drop"]
            assert "output_layer.weight" in cycle["changed_by_drop"]
            assert "fp32_output_scale" in cycle["changed_by_drop"], "fp32 params live in a dropped buffer"


def test_each_cycle_trained_and_ranks_agree(ranks: list[dict]) -> None:
    losses = [c["loss"] for c in ranks[0]["rematerialize"] + ranks[0]["backup"]]
    assert len(set(losses)) == len(losses), "a real optimizer step ran between cycles"
    if len(ranks) == 2:
        for mode in MODES:
            first, second = (rank[mode][-1]["digests"] for rank in ranks)
            dense = [n for n in first if "local_experts" not in n]
            assert {n: first[n] for n in dense} == {n: second[n] for n in dense}, "DP replicas diverged"


def test_extras_are_served_from_the_backup(ranks: list[dict]) -> None:
    assert all(c["served_extras_from_backup"] for rank in ranks for m in MODES for c in rank[m])


def test_backup_pins_every_param_rematerialize_only_extras(ranks: list[dict]) -> None:
    remat = ranks[0]["rematerialize"][0]["pinned"]  # before backup mode allocated its copy
    backup = ranks[0]["backup"][0]["pinned"]
    assert 0 < remat < 1024, "a few hundred bytes of extras"
    assert backup > 200 * remat


def test_a_flipped_bit_is_caught_by_name(ranks: list[dict]) -> None:
    for rank in ranks:
        assert "1 tensor(s) differ: decoder.layers.0.mlp.linear_fc1.weight" in rank["flipped"]


def test_region_bytes_before_the_first_step_count_the_moments_it_makes(ranks: list[dict]) -> None:
    """What `--offload auto` decides from at start-up: the optimizer state as it will be once Adam has
    stepped, equal to what it holds after that step."""
    for rank in ranks:
        before, after = rank["region_bytes"]["before_first_step"], rank["region_bytes"]["after_it"]
        assert before == after and after["default"] > 0, rank["region_bytes"]


def test_the_trainer_digests_with_sha256_on_the_cpu(ranks: list[dict]) -> None:
    assert {rank["digest"] for rank in ranks} == {"sha256"}


def test_memory_is_freed_at_drop_and_returns_at_restore(tmp_path: Path) -> None:
    (result,) = run_ranks("memory", 1, tmp_path)
    held, after = result["held"], result["after_pause"]
    steps = result["steps"]
    for tag in ("param_buffer", "grad_buffer"):
        assert held[tag] > 10 << 20 and after[tag] == 0
        paused = steps[f"pause:{tag}"]
        assert paused["bytes"] == held[tag]
        assert paused["rss"] > 0.9 * held[tag], f"{tag}: RSS fell by {paused['rss']} of {held[tag]} bytes"
    grown = steps["rss_after_rebuild"] - steps["resume:grad_buffer"]["rss_before"]
    assert grown > 0.9 * held["param_buffer"], "the rebuilt params occupy memory again"


def test_layout_covers_every_param_and_the_real_config_allows_rematerialize(ranks: list[dict]) -> None:
    for rank in ranks:
        assert rank["uncovered"] == []
        assert rank["setup_violations"] == []


def test_a_frozen_param_left_out_of_the_extras_fails_at_init_naming_it(ranks: list[dict]) -> None:
    message = ranks[0]["without_frozen"]
    assert "1 configuration problem(s)" in message
    assert "decoder.layers.0.input_layernorm.weight: not rebuilt from the fp32 mains and not an extra" in message
