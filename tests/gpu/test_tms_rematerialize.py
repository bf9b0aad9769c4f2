"""On a GPU: megatron-core (0.19 there) with torch_memory_saver regions, world size 1.

The same scenario as tests/integration, with the param and grad buffers and the optimizer
state re-homed into torch_memory_saver regions: pause returns device memory and resume maps
fresh pages at the same virtual addresses.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MODES = ("rematerialize", "backup")


@pytest.fixture(scope="module")
def rank(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("torch_memory_saver")
    from tests.support.megatron_ranks import run_ranks

    (result,) = run_ranks("cycles", 1, tmp_path_factory.mktemp("gpu"))
    return result


@pytest.mark.parametrize("mode", MODES)
def test_three_cycles_bit_identical_under_torch_memory_saver(rank: dict, mode: str) -> None:
    assert [c["bit_identical"] for c in rank[mode]] == [True] * 3, [c["reason"] for c in rank[mode]]


def test_the_trainer_digests_on_the_device_and_catches_a_flipped_bit(rank: dict) -> None:
    assert rank["digest"] == "device"
    assert "1 tensor(s) differ: decoder.layers.0.mlp.linear_fc1.weight" in rank["flipped"]


@pytest.mark.parametrize("mode", MODES)
def test_pause_returns_device_memory_and_keeps_addresses(rank: dict, mode: str) -> None:
    for cycle in rank[mode]:
        assert cycle["same_address"], "torch_memory_saver resumes at the same virtual address"
        assert cycle["bytes_freed"] >= cycle["param_buffer_bytes"], cycle


@pytest.fixture(scope="module", params=[1, 2], ids=["dp2", "ep2"])
def two_ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The same scenario on two GPUs over NCCL: DP = 2, then EP = 2 (experts in their own buffers)."""
    pytest.importorskip("torch_memory_saver")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    from tests.support.megatron_ranks import run_ranks

    return run_ranks("cycles", 2, tmp_path_factory.mktemp("gpu2"), ep=request.param)


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_restore_bit_identical_at_the_same_addresses(two_ranks: list[dict], mode: str) -> None:
    for rank in two_ranks:
        assert [c["bit_identical"] for c in rank[mode]] == [True] * 3, [c["reason"] for c in rank[mode]]
        assert all(c["same_address"] for c in rank[mode])
        assert all(c["bytes_freed"] >= c["param_buffer_bytes"] for c in rank[mode])
